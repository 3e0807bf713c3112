"""Errors of a group's re-forming that the engine core (plain Python) acts on."""


class LeftOut(RuntimeError):
    """This rank cannot (re)join its group: the group went on without it. No retry can
    help; only restarting the whole group brings the rank back."""
