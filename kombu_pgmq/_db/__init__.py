"""The database layer: the only code that sends SQL (statements from ``sql/``)."""
