"""The ``--config`` flag of the training entry points (``train``, ``train_drafter``, ``tpu_plan``).

``config.model.overrides`` is free-form: it holds whichever ``ModelConfig`` fields a run changes,
so a command line adds keys to it (``--config.model.overrides.num_layers=1``). ml_collections
accepts a key the config does not have only with ``accept_new_attributes=True``, which needs
``lock_config=False``. Nothing else becomes free-form by that: ``default_config()`` locks every
other group itself (a misspelt ``--config.train.num_stpes`` still fails, with ml_collections'
"did you mean"), and ``validate_config`` checks each override against ``ModelConfig`` (name and
type) before anything runs. A new key's value is read as a Python literal (``1``, ``0.5``,
``False``) or else kept as a string (``bfloat16``); give it as ``--flag=value``, since a bare
``--config.model.overrides.x`` reads as ``True``.
"""
from ml_collections import config_flags


def define_config_flag(help_string: str = "Path to a config file with get_config(arg), "
                                          "optionally ':arg'."):
    """``config_flags.DEFINE_config_file("config", ...)`` that takes new model override keys."""
    return config_flags.DEFINE_config_file("config", None, help_string, lock_config=False,
                                           accept_new_attributes=True)
