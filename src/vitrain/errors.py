"""Errors that mean "the user asked for something we cannot do", shown as one line, not a traceback."""


class UserError(Exception):
    """Bad input: a config value, a path, a model name. The message must say what is wrong and how to fix it."""


class DataError(UserError):
    """The dataset is missing, empty, corrupted or in an unknown layout."""


class ModelError(UserError):
    """Unknown model name, weights that cannot be loaded or a checkpoint of another architecture."""
