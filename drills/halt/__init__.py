"""Scenario halt conditions: the spec (``spec``), their evaluation (``evaluate``), the watching task
(``monitor``)."""
