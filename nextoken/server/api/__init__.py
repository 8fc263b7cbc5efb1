"""What every API package builds on: its router, error shape and generating routes
(`routing`), the serving base class (`serving.ApiServing`), the server's state (`state`), the
words of the inert request fields' tables (`published`) and the machinery of cross-field rules
(`rules`)."""
