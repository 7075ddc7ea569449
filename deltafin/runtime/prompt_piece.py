"""How many prompt tokens one pass may read: as many as the free memory holds the pass's activations for.

A prompt read in one pass reads each routed expert it touches once (a streamed model reads it once
from disk), but the pass's activations grow with its rows, and MLA's prompt attention with rows x
context (a score per head, row and cached token, in float32): 8 k tokens of K3 in one pass would
need ~60 GB for the scores alone. So a long prompt goes in the largest pieces whose activations fit
in a share of the room (free memory less headroom: host RAM on the CPU, device memory on a GPU),
each piece reading every expert it routes to once; a prompt that fits goes in one pass, as before.

The estimate is an upper bound of what a pass holds at once, in float32 (``activation_bytes``):
per row the residual stream and its normalized copies, the attention projections, every routed
pair's gate, up and activation, the dense MLP's, and the MLA scores against the whole context; per
pass a fresh prompt's expanded MLA keys and values.
"""
from __future__ import annotations

FLOAT = 4  # bytes: activations and products are float32 on the CPU (and bounded by it on a GPU)
ROOM_SHARE = 0.5  # of the room: the rest stays for the caches, states and the allocator's rounding
MIN_PIECE = 16  # rows: fewer would multiply a streamed model's expert reads for little memory


def _row_and_pass_floats(cfg, context: int) -> tuple[int, int]:
    mla = cfg.mla_num_heads if cfg.mla_layers else 0
    kda = cfg.kda_num_heads * cfg.kda_head_dim if cfg.kda_layers else 0
    q_width = max(mla * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim), 3 * kda)
    per_row = (8 * cfg.hidden_size + 3 * q_width
               + 3 * cfg.experts_per_token * cfg.moe_intermediate_size
               + (3 * cfg.intermediate_size if cfg.first_k_dense else 0)
               + 3 * mla * context)  # scores, masked scores, probabilities
    per_pass = 2 * context * mla * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # expanded keys and values
    return per_row, per_pass


def activation_bytes(cfg, rows: int, context: int) -> int:
    """An upper bound of the activation bytes a pass of `rows` prompt rows holds, the state holding
    `context` tokens once it is read."""
    per_row, per_pass = _row_and_pass_floats(cfg, context)
    return FLOAT * (rows * per_row + per_pass)


def prompt_piece(cfg, prompt_tokens: int, context: int, room: int | None) -> int:
    """Prompt rows per pass for a prompt of `prompt_tokens` tokens after which the state holds
    `context`: all of them when their activations fit in ROOM_SHARE of `room` bytes (None: room
    unknown, one pass as before), else the most that do, at least MIN_PIECE."""
    if room is None or activation_bytes(cfg, prompt_tokens, context) <= ROOM_SHARE * room:
        return prompt_tokens
    per_row, per_pass = _row_and_pass_floats(cfg, context)
    rows = int((ROOM_SHARE * room / FLOAT - per_pass) // max(per_row, 1))
    return max(1, min(prompt_tokens, max(MIN_PIECE, rows)))
