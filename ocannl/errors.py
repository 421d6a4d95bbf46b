"""The port's own exception: OCaml's ``Failure``."""


class Failure(ValueError):
    """OCaml's ``Failure``: an operation could not be carried out on well-typed input."""
