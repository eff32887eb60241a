r"""Linear attention, one algorithm per file (after flash-linear-attention's ``ops/<op>/``):
``naive`` (the quadratic reference), ``parallel`` (non-causal), ``chunk`` (causal: a dispatcher over
``chunk_shared`` and ``chunk_runmax``), ``recurrent`` (one token per step).
"""
