"""Offline tools: plan, inspect and tune schedules before (or after) running them.

``catalog`` (schedule names and their chunks), ``tune`` + ``order_search`` (search schedules and
orders by simulated makespan under a memory limit), ``split_layers`` (a model's layers cut into
stages by ``simulation.partition``), ``profile`` (measure stage costs through the platform),
``trace`` (read, compare and fit traces), ``visualize`` (ASCII charts, Chrome traces, timelines).

May import anything below: the core, the features, ``simulation`` and the platform. Nothing in
the library below the tools imports them (only the CLI and the user do).
"""
