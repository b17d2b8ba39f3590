"""Kernel speed: our Triton kernels against a peer on the same inputs, in one process.

    python -m benchmarks.kernels [--ops chunk_kda,kda_decode_step,mla_decode,causal_conv1d,moe_combine]
        [--chunk-T 1024,8192,32768] [--decode-B 1,8,64] [--mla-T 1024,32768,131072] [--prefill-T 8192] [--rep-ms 200]
        [--chunk-sweep] [--decode-sweep] [--conv-sweep] [--sweep-keys scan_stages,prep_stages]
    python -m benchmarks.kernels --ops moe_decode [--moe-N 1,8] [--moe-sweep]
    python -m benchmarks.kernels --ops moe_prefill [--prefill-T 8192]
    python -m benchmarks.kernels --ops mla_decode_layout [--mla-T 1056,8192]
    python -m benchmarks.kernels --ops mla_absorb
    python -m benchmarks.kernels --ops moe_prefill_rows [--prefill-T 8192]

Needs a CUDA device (SPEC.md §4 anchors are H200 figures). One module per op (chunk_kda.py, kda_decode_step.py, ...)
declares its inputs, ours, the peer, the check, its sizes and sweep as a `Bench` (spec.py); registry.py lists them;
runner.py is the command line; common.py holds the clocks, the records and the sweep. fla is imported from the path
as installed; FLA_FLASH_KDA=0 is set before that import so fla runs its Triton KDA kernels. H=32 heads, head dim 128,
bf16.

Times are medians of `triton.testing.do_bench` (L2 flushed before each call, CUDA events: GPU time), the same
method for ours and the peer; decode shapes also record back-to-back eager times (host launch cost included).
For kernels of a few tens of microseconds do_bench is a poor guide to the time inside the model's decode graph
(the flush leaves dirty L2 lines whose write-back competes with the next kernel's reads; such figures have
swung by 1.6x between runs, docs/kernels.md), so the choices of launch configs use `graph_ms` instead: the calls
of GRAPH_LAYERS layers (each its own weights or state) captured in one CUDA graph. The decode step is also timed that
way on both sides (`ours_graph_ms`, `peer_graph_ms`), and by the profiler (`ours_kernel_ms`, `peer_kernel_ms`: the
kernels' own device time, launch gaps left out; see `kernel_ms`); the summary states the targets by all three.
Outputs are compared in the same run (relative RMS error, the peer as the reference). One `kernel` record per shape;
an error in one shape or side becomes an INVALID record and the run goes on. Without fla, ours is still timed
and every record of the fla benches is INVALID with reason "peer unavailable: ...".
"""
