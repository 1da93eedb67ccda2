"""The project's exception types. The CLI maps them to exit codes; library code never exits."""


class EdgeLLMError(Exception):
    """Base class. `exit_code` is what the CLI returns for it."""

    exit_code = 2


class InputError(EdgeLLMError):
    """Bad input: a config, a checkpoint, a path or an option the user gave. Exit code 2."""

    exit_code = 2


class ConfigError(InputError):
    """One or more problems in a configuration, reported together."""

    def __init__(self, problems):
        self.problems = list(problems)
        super().__init__("; ".join(self.problems))


class BackendUnavailable(InputError):
    """A backend whose SDK is not importable here."""


class VerificationError(EdgeLLMError):
    """A program was built but does not match its eager model. Exit code 1."""

    exit_code = 1
