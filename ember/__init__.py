"""ember: serverless inference whose cold starts walk a ladder of warm rungs."""

__version__ = "0.1.0"
