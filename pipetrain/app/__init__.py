"""The ``pipetrain`` application: the command line, its jobs, and built-in models and data.

The library (everything outside this package) never imports it.
"""
