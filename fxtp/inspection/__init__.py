"""Inspection: ``fxtp.explain``'s report (text, JSON, HTML), stage dumps, and counting the
collectives a region of code issues."""
