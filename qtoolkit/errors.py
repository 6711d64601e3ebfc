"""Errors a user can cause. Each message names the problem and the fix; the CLI maps them to exit code 2."""


class QToolError(Exception):
    """Base class for user-caused errors (bad input, missing files, bad recipes)."""

    exit_code = 2


class ModelSourceError(QToolError):
    """The model source cannot be found or is not a usable model."""


class RecipeError(QToolError):
    """The recipe is unknown, malformed or inconsistent with the model."""


class OutputExistsError(QToolError):
    """The output path exists and --overwrite was not given."""


class DataError(QToolError):
    """Input data (completions, prompts, calibration sets) is malformed."""


class BackendError(QToolError):
    """A model backend cannot be built or does not answer."""


class DraftHeadError(QToolError):
    """A draft head folder is missing, malformed, or does not fit the target it is meant to draft for."""


class OutputWriteError(QToolError):
    """Writing an output failed (a full disk, a file-size or quota limit, a read-only folder); what was there
    before is intact."""
