"""The hot path in one box: one forward pass (``engine``), its recorded CUDA form (``decode_graph``),
one decoding driven a pass at a time (``generate``), many of them sharing passes (``scheduler``),
and decode states kept on disk (``saved_state``). Nothing here knows where weights come from
(``io``) or who asked for the tokens (the front ends)."""
