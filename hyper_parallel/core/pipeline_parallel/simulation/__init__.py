"""The timing model: how long a schedule takes and how much it keeps alive, without a tensor.

``costs`` (per-stage, per-step costs and their file format), ``partition`` (layers balanced
over stages by cost), ``timed_model`` (runs every rank's
lowered list against those costs, each message after its send), ``simulate`` (makespan, bubble,
peak activations and a trace of a plan). Used by the offline tools and by features that plan
(MPipe picks its warm-up with it).

May import: ``ir``, ``lowering``, ``schedules``. Never the runtime, a tensor or a framework.
"""
