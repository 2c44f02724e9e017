"""MPipe: a multimodal encoder's layers transposed across the pipeline ranks during warm-up.

``transpose`` (`ScheduleMPipeTranspose` and its runtime steps), ``plan`` (which rank runs which
transposed layer and the messages that moves), ``model`` (the plan's compute lists, checked and
simulated, and the warm-up comparison the docs show).

May import: what the other features may (the core, ``simulation``, the platform) and the other
features (``compiled_check``). Never the tools.
"""
