"""The implant service (`pointforge serve`): an HTTP API and a plain web page over `generate`.

``settings`` (what the command line sets and the rules it must keep),
``store`` (jobs in SQLite: the queue that survives a crash), ``uploads``
(an upload checked from its content and written atomically before it is
queued), ``dicom`` (a CT series in a zip → a bone mask), ``worker`` (threads
that run queued jobs through :func:`pointforge.implant.case.generate_case`
and keep finished cases within the disk bound), ``security`` (token,
origin and host checks, response headers), ``app`` (the FastAPI routes) and
``service`` (all of it started together under uvicorn). ``page/`` holds the
HTML, JavaScript and CSS the service sends; every action there is an API call.
"""
