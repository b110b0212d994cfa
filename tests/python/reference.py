"""An independent NumPy reference of docs/semantics.md §2 and §3, for the binding's tests.

Written from the semantics document, not from the daemon's code: dispatch outputs per
destination rank (NON_EXPAND and EXPAND, counts included) and combine's exact fp32 reduction.
"""

import numpy as np


def _bf16_float(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def _float_bf16(f):
    f = np.ascontiguousarray(f, dtype=np.float32)
    b = f.view(np.uint32)
    out = ((b + (0x7FFF + ((b >> 16) & 1))) >> 16).astype(np.uint16)
    out[np.isnan(f)] = 0x7FFF
    return out


class Routing:
    """Dispatch of every rank's inputs, as every destination sees it.

    ``xs[s]`` are the payload rows of source s (any dtype, compared bitwise), ``topks[s]``
    ``[N_s, K]`` expert ids, ``weights[s]`` ``[N_s, K]`` float32 or None, ``scales[s]`` or None.
    """

    def __init__(self, world_size, num_experts, max_tokens, xs, topks, weights=None,
                 scales=None, layout="non_expand", alignment=1, block_rows=0):
        self.R, self.E, self.T = world_size, num_experts, max_tokens
        self.L = num_experts // world_size
        self.xs, self.topks, self.weights, self.scales = xs, topks, weights, scales
        self.layout, self.alignment = layout, alignment
        self.block_rows = block_rows  # C of §2.6 (EXPAND with fixed expert blocks), 0: packed

    def dest(self, d):
        """Expected outputs of destination rank d, as a dict (padding rows hold None)."""
        R, L, T = self.R, self.L, self.T
        ne_rows, prefix = [], []
        for s in range(R):
            prefix.append(len(ne_rows))
            for t in range(len(self.topks[s])):
                if any(e >= 0 and e // L == d for e in self.topks[s][t]):
                    ne_rows.append((s, t))
        prefix.append(len(ne_rows))
        sel = [[] for _ in range(L)]
        for s in range(R):
            for t in range(len(self.topks[s])):
                for k, e in enumerate(self.topks[s][t]):
                    if e >= 0 and e // L == d:
                        sel[e % L].append((s, t, k))
        counts = [len(g) for g in sel]
        a = self.alignment
        aligned = [(c + a - 1) // a * a for c in counts]
        C = self.block_rows
        out = {"num_recv_tokens": len(ne_rows),
               "num_expanded_rows": L * C if C else sum(aligned),
               "per_expert": counts, "aligned": aligned, "rank_prefix": prefix}
        if self.layout == "non_expand":
            out["rows"] = ne_rows
            K = self.topks[0].shape[1] if len(self.topks) else 0
            idx, w = [], []
            for s, t in ne_rows:
                row = self.topks[s][t]
                idx.append([e - d * L if e >= 0 and e // L == d else -1 for e in row])
                if self.weights is not None:
                    w.append([self.weights[s][t][k] if row[k] >= 0 and row[k] // L == d
                              else 0.0 for k in range(len(row))])
            out["recv_topk_idx"] = np.array(idx, dtype=np.int64).reshape(-1, K)
            out["recv_weights"] = (np.array(w, dtype=np.float32).reshape(-1, K)
                                   if self.weights is not None else None)
            out["recv_src"] = np.array([s * T + t for s, t in ne_rows], dtype=np.int64)
        else:
            rows = []
            for i in range(L):
                rows += sel[i] + [None] * ((C if C else aligned[i]) - counts[i])
            out["rows"] = rows
            out["recv_src"] = np.array([r[0] * T + r[1] if r else -1 for r in rows], np.int64)
            out["recv_topk_slot"] = np.array([r[2] if r else -1 for r in rows], np.int32)
            out["recv_weights"] = (np.array([self.weights[r[0]][r[1]][r[2]] if r else 0.0
                                             for r in rows], np.float32)
                                   if self.weights is not None else None)
        return out

    def recv_x(self, d, zero_padding_value=None):
        """Expected recv_x of d; padding rows are ``zero_padding_value`` (None: unchecked)."""
        info = self.dest(d)
        rows = []
        for r in info["rows"]:
            if r is None:
                rows.append(None)
            else:
                rows.append(self.xs[r[0]][r[1]])
        return rows

    def combine(self, s, ys, biases=(), apply_weights=False, source_weights=None):
        """Expected combined output (uint16 bf16 bits) of source s.

        ``ys[d]`` is destination d's y (uint16 ``[rows, H]``) in the dispatch layout.
        ``source_weights`` (float32 ``[N_s, K]``), when given, is w(t, k) of apply_weights
        instead of the dispatch's weights.
        """
        weights = source_weights if source_weights is not None else \
            self.weights[s] if self.weights is not None else None
        R, L = self.R, self.L
        topk = self.topks[s]
        n, K = topk.shape
        H = ys[0].shape[1] if len(ys) and ys[0].ndim == 2 else (self.xs[s].shape[1])
        # Where each (t, k) contribution sits: (d, row) or None.
        where = {}
        for d in range(R):
            info = self.dest(d)
            for i, r in enumerate(info["rows"]):
                if r is None:
                    continue
                if self.layout == "non_expand":
                    src, t = r
                    if src != s:
                        continue
                    ks = [k for k in range(K) if topk[t][k] >= 0 and topk[t][k] // L == d]
                    where[(t, ks[0])] = (d, i)
                else:
                    src, t, k = r
                    if src == s:
                        where[(t, k)] = (d, i)
        acc = np.zeros((n, H), dtype=np.float32)
        for k in range(K):
            v = np.zeros((n, H), dtype=np.float32)
            for t in range(n):
                if (t, k) in where:
                    d, i = where[(t, k)]
                    row = _bf16_float(ys[d][i])
                    if apply_weights:
                        row = row * np.float32(weights[t][k])
                    v[t] = row
            acc = acc + v
        for b in biases:
            acc = acc + _bf16_float(b)
        return _float_bf16(acc)

    def combined_weights(self, s, recv_weights=None):
        """Expected combined_topk_weights of source s: the dispatch's weights masked to 0 at
        -1 entries or, with ``recv_weights`` (``[R]`` of float32 ``[rows_d, K]``, NON_EXPAND),
        for every k the fp32 sum, from +0 in ascending rank d, of d's row of each token that
        went to d."""
        if recv_weights is None:
            w = np.array(self.weights[s], dtype=np.float32)
            return np.where(self.topks[s] >= 0, w, np.float32(0))
        n, K = self.topks[s].shape
        acc = np.zeros((n, K), dtype=np.float32)
        for d in range(self.R):
            for i, (src, t) in enumerate(self.dest(d)["rows"]):
                if src == s:
                    acc[t] = acc[t] + np.asarray(recv_weights[d][i], dtype=np.float32)
        acc.view(np.uint32)[np.isnan(acc)] = 0x7FFFFFFF  # a NaN sum's bits
        return acc


# ---- §2.7 quantizing dispatch ----

_INV_448 = np.float32(float.fromhex("0x1.24924ap-9"))


def _e4m3_table():
    """The non-negative finite e4m3 values, indexed by their byte 0x00..0x7E."""
    vals = []
    for b in range(0x7F):
        e, m = b >> 3, b & 7
        vals.append(m / 8.0 * 2.0 ** -6 if e == 0 else (1 + m / 8.0) * 2.0 ** (e - 7))
    return np.array(vals, dtype=np.float64)


_E4M3 = _e4m3_table()


def e4m3(v):
    """float32 values to e4m3 bytes: nearest, ties to the even byte, subnormals included;
    beyond ±448 (and ±inf) saturate to ±448; NaN is 0x7F."""
    v = np.asarray(v, dtype=np.float32)
    a = np.abs(v.astype(np.float64))
    hi = np.clip(np.searchsorted(_E4M3, a), 0, len(_E4M3) - 1)
    lo = np.clip(hi - 1, 0, len(_E4M3) - 1)
    dlo, dhi = a - _E4M3[lo], _E4M3[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    pick = np.where(a >= _E4M3[-1], len(_E4M3) - 1, pick)
    out = pick.astype(np.uint8) | np.where(np.signbit(v), 0x80, 0).astype(np.uint8)
    out[np.isnan(v)] = 0x7F
    return out


def _pow2_exponent(m):
    """⌈log2 m⌉ of positive float32 values m, normal or +inf (128): frexp gives m = f·2^x with
    f in [0.5, 1), which is a power of two exactly when f is 0.5."""
    f, x = np.frexp(m.astype(np.float64))
    e = np.where(f == 0.5, x - 1, x).astype(np.int32)
    return np.where(np.isinf(m), 128, e).astype(np.int32)


def quantize(x_bits, block=128, round_scale=False, ue8m0=False):
    """§2.7 of bf16 rows ``[N, H]`` (uint16 bits): (e4m3 bytes ``[N, H]``, scales): fp32
    ``[N, H / block]``, with ``round_scale`` the powers of two 2^e (x times 2^-e), with
    ``ue8m0`` (and round_scale) the bytes e + 127 as uint8 ``[N, H / block]``."""
    f = _bf16_float(x_bits).reshape(x_bits.shape)
    n, h = f.shape
    q = np.empty((n, h), np.uint8)
    scales = np.empty((n, h // block), np.uint8 if ue8m0 else np.float32)
    for b in range(h // block):
        blk = f[:, b * block:(b + 1) * block]
        amax = np.nanmax(np.where(np.isnan(blk), np.float32(0), np.abs(blk)), axis=1)
        amax = np.maximum(amax, np.float32(1e-4)).astype(np.float32)
        m = (amax * _INV_448).astype(np.float32)
        if round_scale:
            e = _pow2_exponent(m)
            with np.errstate(over="ignore"):
                scale = np.ldexp(np.float32(1), -e).astype(np.float32)
                recv = np.ldexp(np.float32(1), e).astype(np.float32)
        else:
            scale = (np.float32(448.0) / amax).astype(np.float32)
            recv = m
        q[:, b * block:(b + 1) * block] = e4m3((blk * scale[:, None]).astype(np.float32))
        scales[:, b] = (e + 127).astype(np.uint8) if ue8m0 else recv
    return q, scales
