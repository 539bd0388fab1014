"""The session browser (``loomray ui``, extra ``loomray[ui]``): sessions, transcripts, fork trees and approvals
in a web page, served by Starlette on uvicorn over a store.

An application beside the command line: nothing in the library imports it.
:func:`loomray.ui.server.build_app` makes the ASGI app, :func:`loomray.ui.server.serve` runs it.
"""
