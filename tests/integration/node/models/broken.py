"""A user module that cannot be imported: the node must answer ModelNotReady naming the cause."""

import ember_no_such_dependency  # noqa: F401


class Model:
    def load(self, weights: object, options: dict) -> None: ...

    def infer(self, inputs: dict) -> dict: ...
