"""Fakes for ember's Protocols (clock, node, ...), used by the tests instead of mocks."""
