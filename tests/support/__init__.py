"""Helpers shared by the test suite (database provisioning lives in :mod:`.pgserver`)."""
