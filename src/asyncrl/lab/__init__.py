"""The lab: asyncrl's study tooling, apart from the library a user imports.

The lab imports the core (``asyncrl`` outside this package); the core never imports the lab
(``unit_tests/test_import_graph.py`` walks every import statement to hold that, and that no import
circle exists). Its modules:

- ``tasks``: the built-in synthetic tasks (``addition``, ``running_sum``, ``running_sum_long``,
  ``reverse``); ``presets``: the tiny teacher/student presets (``tiny``, ``small``, ``tiny-gpt2``,
  ``qwen-tiny``) and ``build_model``; ``pretrain``: ``asyncrl pretrain``, training and caching a
  preset pair on a task.
- ``sweep``: grids of runs (``asyncrl sweep``); ``aggregate`` and ``sweep_report``: a sweep's
  tables, plots and page; ``report``: the HTML report over run directories (``asyncrl report``).
- ``simulator``: the discrete-event model of the pipeline's admission and staleness bound.
- ``evidence`` and ``stats``: the experiment evidence behind EXPERIMENTS.md and its statistics.

The built-in tasks and presets reach the core's registries (``asyncrl.workloads.tasks.TASKS``,
``asyncrl.workloads.models.PRESETS``) the way a third-party plugin's components do: ``lab.tasks``
and ``lab.presets`` are the ``asyncrl.task`` and ``asyncrl.preset`` entry points (pyproject.toml)
and register their entries when imported; a registry loads its group the first time it is asked
for a name it does not hold (``asyncrl.registry.load_plugins``), in the driver and in every Ray
worker alike.
"""
