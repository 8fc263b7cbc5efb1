"""What every API package builds on: its router, error shape and generating routes
(`routing`), the serving base class (`serving.ApiServing`), the server's state (`state`), the
request fields published but inert (`published`) and the cross-field rules (`rules`)."""
