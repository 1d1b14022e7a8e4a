"""The benchmarks' command-line options and the engine benchmark's model presets: light enough to import
before any kernel (``pagedmla bench`` must pick the Triton interpreter on CPU before the kernels load)."""

from __future__ import annotations

import argparse

_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}
PRESETS = {
    "v2-lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048, intermediate_size=10944,
                    moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16,
                    q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                    n_routed_experts=64, n_shared_experts=2, num_experts_per_tok=6, n_group=1, topk_group=1,
                    topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
                    first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=163840,
                    rope_parameters=_YARN, rms_norm_eps=1e-6, bos_token_id=100000, eos_token_id=100001),
    "tiny": dict(model_type="deepseek_v2", vocab_size=512, hidden_size=256, intermediate_size=512,
                 moe_intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                 q_lora_rank=None, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
                 n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                 topk_method="greedy", scoring_func="softmax", norm_topk_prob=False, routed_scaling_factor=1.0,
                 first_k_dense_replace=1, moe_layer_freq=1, max_position_embeddings=4096,
                 rope_parameters={**_YARN, "factor": 4.0, "original_max_position_embeddings": 1024},
                 rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1),
}


def decode_arguments(ap: argparse.ArgumentParser) -> None:
    """Options of the decode benchmark (``benchmarks/bench_decode.py``, ``pagedmla bench decode``)."""
    ap.add_argument("--quick", action="store_true", help="a six-cell subset (CPU: two tiny cells)")
    ap.add_argument("--flashinfer", action="store_true", help="also time FlashInfer fa3 (JIT-compiles, ~30-80 s)")
    ap.add_argument("--no-flashmla", action="store_true", help="skip FlashMLA even when it is installed")
    ap.add_argument("--torch", action="store_true", help="also time the torch reference provider (always on CPU)")
    ap.add_argument("--csv", help="write the table as CSV here")
    ap.add_argument("--plot", help="write a PNG bar chart of the ratios here")
    ap.add_argument("--sweep", nargs="?", const="", metavar="SPECS",
                    help="time pagedmla kernel configs instead of the grid: the built-in lists, or these "
                         "comma-separated specs with parts per SM (e.g. m16n32w4s2c4x2,m16n32w4s3c4px2)")
    ap.add_argument("--graphs", action="store_true",
                    help="time every cell as CUDA-graph replays too (no host launch cost), both libraries")
    ap.add_argument("--alt", action="store_true",
                    help="also time the other main kernel (Hopper kernel vs the portable kernel's default tile)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time pagedmla and the baselines in turn this many times per cell, keeping each one's "
                         "best (the GPU's clocks fall under sustained load)")


def prefill_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the prefill benchmark (``benchmarks/bench_prefill.py``, ``pagedmla bench prefill``)."""
    parser.add_argument("--flashinfer", action="store_true", help="also time FlashInfer fa3 (JIT compiles 30-80 s)")
    parser.add_argument("--variants", action="store_true", help="time several Triton tile configurations")
    parser.add_argument("--quick", action="store_true", help="fewer cells")
    parser.add_argument("--csv", metavar="PATH", help="write every measurement to PATH")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the ratios to PATH")
    parser.add_argument("--only", choices=("ragged", "skewed", "paged", "merge"), action="append",
                        help="run only these parts")
    parser.add_argument("--rounds", type=int, default=1,
                        help="time each cell's implementations in turn this many times, keeping each one's best "
                             "(the GPU's clocks fall under sustained load)")


def engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of the serving benchmark (``benchmarks/bench_engine.py``, ``pagedmla bench engine``)."""
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help="default: v2-lite on CUDA, tiny on CPU")
    parser.add_argument("--device", default=None, help="default: cuda when available")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--quick", action="store_true", help="a smaller workload")
    parser.add_argument("--num-requests", type=int, default=None, help="default: 64 on CUDA")
    parser.add_argument("--prompt-len", default=None, help="MIN:MAX, uniform (default on CUDA: 128:512)")
    parser.add_argument("--output-len", default=None, help="MIN:MAX, uniform (default on CUDA: 64:256)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="engine max_batch_size and transformers' batch (default on CUDA: 64)")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--mixed", action="store_true", help="MIXED prefill + decode steps")
    parser.add_argument("--providers", default=None, help="comma list (default: torch,triton,flashmla available)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="comma list of cache formats to serve with (auto, bf16, fp8_e4m3, fp8_ds_mla; "
                             "default: auto, the model's dtype)")
    parser.add_argument("--cuda-graph", choices=("on", "off", "both"), default=None,
                        help="default: both on CUDA, off on CPU")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    parser.add_argument("--speculative", choices=("mtp",), default=None,
                        help="also serve with MTP speculative decoding (a random-weight MTP layer: low acceptance)")
    parser.add_argument("--num-speculative-tokens", type=int, default=2, help="MTP draft tokens per step (1-4)")
    parser.add_argument("--draft-graph", choices=("fused", "per_step"), default="fused",
                        help="with CUDA graphs: one graph for the MTP draft decodes, or one per step")
    parser.add_argument("--profile-attention", action="store_true",
                        help="one more eager run per provider timing every attention call (after warm-up)")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the throughputs to PATH")
    parser.add_argument("--seed", type=int, default=0)
