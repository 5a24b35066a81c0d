"""Constants every backend shares.

CHUNK: tokens per chunk of the chunked forms. FLA 0.6.0's kernels, which the
triton backend reuses for the stages ReWY leaves alone, are built for 64, and
the torch backend uses the same chunking so that both compute the same sums
in the same grouping.

RCP_LN2: 1 / ln 2. FLA keeps chunk-local gate cumsums in log2 units (it scales
by this and uses exp2), and rewy's Triton kernels read them as FLA writes them.
"""

CHUNK = 64
RCP_LN2 = 1.4426950408889634
