"""Game-day mode: manual steps a drill pauses at, and the operator's `kvdrill continue` / `kvdrill note`.

``inbox`` carries a message from the command to the running kvdrill process (request file + SIGUSR2,
the same registry and pid/start-time identity as ``kvdrill abort``); ``desk`` receives it inside that
process and is the only place that writes it to the journal; ``pause`` is the wait itself; ``steps``
reads the human steps back out of a journal for the reports.
"""
