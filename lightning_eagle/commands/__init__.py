"""Every command line of lightning_eagle, above the library: nothing outside this package imports it.

``cli`` is the ``lightning-eagle`` entry point (LightningCLI ``fit``/``validate``/``test``/``predict`` plus the
commands in :data:`~lightning_eagle.commands.cli.COMMANDS`); each other module is one command, also runnable as
``python -m lightning_eagle.commands.<name>``.
"""
