"""Hooks that record what each stage of the pipeline did (behind `nextoken explain`).

The model and the generation loop call a tracer only when one is passed (``tracer is not
None``); without one tracing costs nothing.
"""
