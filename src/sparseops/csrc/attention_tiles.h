// The work of the C++ attention kernels (csrc/attention.cpp): an item is a tile of consecutive query tokens of one
// KV head (and group of W heads), and two tokens' keys over the same rows run together as one unit (the products'
// *2 forms: each loaded key element serves both).
// - Blocks and ranges: each token's keys are cut into visits of at most KEY_BLOCK consecutive rows (cut at
//   multiples of KEY_BLOCK positions, so that neighbours' visits coincide); two tokens' visits of the same rows
//   form a unit, units in the order of their rows, so that a row's key, value, dK and dV stay in the cache while
//   the tile's tokens visit it.
// - Token granularity: tiles of two neighbours, whose common rows form units of both and the rest units of one.
#pragma once

#include "attention_items.h"
#include "attention_products.h"
#include "cpu.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sparseops_attn {

// query tokens per tile item: blocks and ranges (whose visits pair across the tile); token granularity (a pair of
// neighbours: its per-token score buffers are long, and its keys pair by row, not by visit)
constexpr int64_t TILE = 16, TOKEN_TILE = 2;

// Token granularity (bs < 16): a token's keys are single rows or short runs, paired row by row.
template <typename T> bool token_mode(const Args<T>& a) { return a.topk != nullptr && a.bs < 16; }
template <typename T> int64_t tile_size(const Args<T>& a) { return token_mode(a) ? TOKEN_TILE : TILE; }

// At most KEY_BLOCK consecutive key positions of one tile token: the flat rows row0 + i * N2 (i < n); tok: the
// token's index in the tile.
struct Visit {
  int64_t row0, n, tok;
};

// One unit of work: the n rows pool[r0 .. r0 + n) for token a (its scores at a_off in its buffer) and, when b >= 0,
// for token b at b_off: each loaded key element then serves both.
struct Unit {
  int64_t r0, n, a, a_off, b, b_off;
};

template <typename T> struct TileScratch {
  typedef typename Vec<T>::type V;
  std::vector<Visit> visits;
  std::vector<Unit> units;
  std::vector<int64_t> pool, slot, rows, slots, count, only;
  std::vector<int32_t> mark;
  std::vector<char> used;
  std::vector<V> s, p, xT, yT, oT, ls, dl, mx, sum;
  std::vector<T> qN, yN;
  // tile: tokens per item; KB: the most keys one token sees; R: flat key rows; bwd: the backward's buffers, else
  // the forward's
  TileScratch(int64_t tile, int64_t KB, int64_t R, int64_t D, int64_t Dv, bool bwd, bool tokens)
      : slot(bwd || !tokens ? 0 : tile * KB), rows(tokens ? 2 * KB : 0), slots(tokens ? 2 * KB : 0), count(tile),
        mark(tokens ? R : 0, -1), s(bwd ? 0 : tile * KB), p(bwd ? 4 * KEY_BLOCK : 0), xT(tile * D),
        yT(bwd ? tile * Dv : 0), oT(tile * std::max(D, Dv)), ls(tile), dl(tile), mx(tile), sum(tile),
        qN(bwd ? tile * Vec<T>::W * D : 0), yN(bwd ? tile * Vec<T>::W * Dv : 0) {}

  // a unit of the n rows rows[idx[k]] (k < n), for token a (its k-th row has slot sa[idx[k]]) and token b (or -1;
  // its k-th row at index ib[k] of its list, slot sb[ib[k]]); slots: only where a score buffer keeps them
  void add_unit(const int64_t* rows_, const int64_t* idx, int64_t n, int64_t a, const int64_t* sa, int64_t b,
                const int64_t* ib, const int64_t* sb, int64_t KB) {
    units.push_back({int64_t(pool.size()), n, a, count[a], b, b >= 0 ? count[b] : 0});
    for (int64_t k = 0; k < n; ++k) pool.push_back(rows_[idx[k]]);
    if (!slot.empty()) {
      for (int64_t k = 0; k < n; ++k) slot[a * KB + count[a] + k] = sa[idx[k]];
      if (b >= 0)
        for (int64_t k = 0; k < n; ++k) slot[b * KB + count[b] + k] = sb[ib[k]];
    }
    count[a] += n;
    if (b >= 0) count[b] += n;
  }
};

// Blocks and ranges: the visits of tile tokens [t0, t1) at KV head n2 (cut at multiples of KEY_BLOCK positions,
// so that neighbours' visits coincide), sorted by rows, then paired: two visits of the same rows by different
// tokens form one unit (a token's repeated block is never paired with itself).
template <typename T> void plan_blocks(const Args<T>& a, int64_t t0, int64_t t1, int64_t n2, TileScratch<T>& sc) {
  auto& vs = sc.visits;
  vs.clear();
  auto add = [&](int64_t tok, int64_t base, int64_t p0, int64_t p1) {  // positions [p0, p1) of keys from row base
    while (p0 < p1) {
      const int64_t e = std::min(p1, (p0 / KEY_BLOCK + 1) * KEY_BLOCK);
      vs.push_back({(base + p0) * a.N2 + n2, e - p0, tok});
      p0 = e;
    }
  };
  for (int64_t t = t0; t < t1; ++t) {
    if (a.topk == nullptr) {
      add(t - t0, 0, a.lo[t], a.hi[t]);
      continue;
    }
    const int64_t* ids = a.topk + (t * a.N2 + n2) * a.K;
    const int64_t lim = a.causal ? std::min(a.seq_len[t], a.pos[t] + 1) : a.seq_len[t], blocks = block_count(a, t);
    for (int64_t i = 0; i < a.K; ++i)
      if (live_block(ids[i], blocks)) add(t - t0, a.kv_start[t], ids[i] * a.bs, std::min(ids[i] * a.bs + a.bs, lim));
  }
  std::sort(vs.begin(), vs.end(), [](const Visit& x, const Visit& y) {
    return x.row0 != y.row0 ? x.row0 < y.row0 : x.n != y.n ? x.n < y.n : x.tok < y.tok;
  });
  sc.used.assign(vs.size(), 0);
  int64_t rows[KEY_BLOCK], idx[KEY_BLOCK];
  for (int64_t k = 0; k < KEY_BLOCK; ++k) idx[k] = k;
  for (size_t i = 0; i < vs.size(); ++i) {
    if (sc.used[i]) continue;
    int64_t b = -1;  // the next unused visit of the same rows by another token
    for (size_t j = i + 1; j < vs.size() && vs[j].row0 == vs[i].row0 && vs[j].n == vs[i].n; ++j)
      if (!sc.used[j] && vs[j].tok != vs[i].tok) {
        b = int64_t(j);
        break;
      }
    sc.used[i] = 1;
    if (b >= 0) sc.used[b] = 1;
    for (int64_t k = 0; k < vs[i].n; ++k) rows[k] = vs[i].row0 + k * a.N2;
    sc.add_unit(rows, idx, vs[i].n, vs[i].tok, nullptr, b >= 0 ? vs[b].tok : -1, nullptr, nullptr, 0);
  }
}

// Token granularity: each pair of tokens (t0 + 2i, t0 + 2i + 1) of the tile split into the rows both see (units of
// both, at most KEY_BLOCK rows each) and the rows only one sees; a row repeated in one token's list pairs once.
template <typename T>
void plan_tokens(const Args<T>& a, int64_t t0, int64_t t1, int64_t n2, TileScratch<T>& sc) {
  const int64_t KB = a.K * a.bs;
  int64_t* ra = sc.rows.data();
  int64_t *sa = sc.slots.data(), *rb = ra + KB, *sb = sa + KB;
  for (int64_t i = 0; i < t1 - t0; i += 2) {
    const int64_t na = visible_rows(a, t0 + i, n2, ra, sa);
    const int64_t nb = i + 1 < t1 - t0 ? visible_rows(a, t0 + i + 1, n2, rb, sb) : 0;
    for (int64_t j = 0; j < na; ++j)
      if (sc.mark[ra[j]] == -1) sc.mark[ra[j]] = int32_t(j);
    sc.used.assign(na, 0);
    std::vector<int64_t>& only = sc.only;  // B's rows seen by B alone, then A's
    only.clear();
    int64_t ia[KEY_BLOCK], ib[KEY_BLOCK], n = 0;
    for (int64_t j = 0; j < nb; ++j) {
      const int32_t m = sc.mark[rb[j]];
      if (m < 0) {
        only.push_back(j);
        continue;
      }
      sc.mark[rb[j]] = -2;  // taken: the row's next copy in B is B's alone
      sc.used[m] = 1;
      ia[n] = m;
      ib[n++] = j;
      if (n == KEY_BLOCK) {
        sc.add_unit(ra, ia, n, i, sa, i + 1, ib, sb, KB);
        n = 0;
      }
    }
    if (n > 0) sc.add_unit(ra, ia, n, i, sa, i + 1, ib, sb, KB);
    const int64_t nbo = int64_t(only.size());
    for (int64_t j = 0; j < na; ++j) {
      sc.mark[ra[j]] = -1;
      if (!sc.used[j]) only.push_back(j);
    }
    for (int64_t k = 0; k < nbo; k += KEY_BLOCK)
      sc.add_unit(rb, only.data() + k, std::min(KEY_BLOCK, nbo - k), i + 1, sb, -1, nullptr, nullptr, KB);
    for (int64_t k = nbo; k < int64_t(only.size()); k += KEY_BLOCK)
      sc.add_unit(ra, only.data() + k, std::min<int64_t>(KEY_BLOCK, int64_t(only.size()) - k), i, sa, -1, nullptr,
                  nullptr, KB);
  }
}

// The tile's units: pool, count and (token granularity, forward) slot filled.
template <typename T> void plan_tile(const Args<T>& a, int64_t t0, int64_t t1, int64_t n2, TileScratch<T>& sc) {
  sc.units.clear();
  sc.pool.clear();
  std::fill(sc.count.begin(), sc.count.end(), 0);
  if (token_mode(a))
    plan_tokens(a, t0, t1, n2, sc);
  else
    plan_blocks(a, t0, t1, n2, sc);
}

// Runs fn(item, task, scratch) for every tile item (tile, n2, hb), dealt round-robin to P tasks, one thread each.
template <typename T, typename F> void for_tiles(const Args<T>& a, int64_t P, bool bwd, F fn) {
  const int64_t tile = tile_size(a), items = (a.T1 + tile - 1) / tile * a.N2 * a.HB;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    TileScratch<T> sc(tile, a.K * a.bs, a.R, a.D, a.Dv, bwd, token_mode(a));
    for (int64_t it = tid; it < items; it += P) fn(it, tid, sc);
  });
}

// tgt (token granularity, or null): each item's share of the DSA loss's target, [T1, N2 * HB, K] with
// tgt[t, item, slot] = (1 / N1) sum over the item's heads of its softmax at the slot's key (0 where none).
template <typename T> void forward_tiles(const Args<T>& a, T* out, T* m, T* l, T* tgt, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const int64_t KB = a.K * a.bs, Do = std::max(a.D, a.Dv), tile = tile_size(a);
  for_tiles(a, P, false, [&](int64_t it, int64_t, TileScratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t0 = it / (a.HB * a.N2) * tile;
    const int64_t t1 = std::min(a.T1, t0 + tile);
    const Heads<T> h(a.G, n2, hb);
    plan_tile(a, t0, t1, n2, sc);
    for (int64_t i = 0; i < t1 - t0; ++i) {
      load_heads(a.q, t0 + i, a.N1, a.D, h, sc.xT.data() + i * a.D, static_cast<T*>(nullptr), a.qscale);
      std::fill(sc.oT.begin() + i * Do, sc.oT.begin() + (i + 1) * Do, V{});
    }
    V* s = sc.s.data();
    for (const Unit& u : sc.units) {  // scores
      const int64_t* rows = sc.pool.data() + u.r0;
      if (u.b < 0)
        row_scores<T>(sc.xT.data() + u.a * a.D, a.D, a.k, rows, u.n, a.D, s + u.a * KB + u.a_off);
      else
        row_scores2<T>(sc.xT.data() + u.a * a.D, sc.xT.data() + u.b * a.D, a.D, a.k, rows, u.n, a.D,
                       s + u.a * KB + u.a_off, s + u.b * KB + u.b_off);
    }
    for (int64_t i = 0; i < t1 - t0; ++i) {
      sc.sum[i] = sc.mx[i] = V{};  // a token that sees no key: out, m, l are 0
      if (sc.count[i] > 0) sc.sum[i] = softmax_terms<T>(s + i * KB, sc.count[i], a.floor, sc.mx[i]);
    }
    for (const Unit& u : sc.units) {  // P V
      const int64_t* rows = sc.pool.data() + u.r0;
      if (u.b < 0)
        row_combine<T>(s + u.a * KB + u.a_off, a.v, rows, u.n, a.Dv, a.Dv, sc.oT.data() + u.a * Do);
      else
        row_combine2<T>(s + u.a * KB + u.a_off, s + u.b * KB + u.b_off, a.v, rows, u.n, a.Dv, a.Dv,
                        sc.oT.data() + u.a * Do, sc.oT.data() + u.b * Do);
    }
    for (int64_t i = 0; i < t1 - t0; ++i) {
      const int64_t t = t0 + i;
      const V sum = sc.sum[i];
      V inv;
      for (int j = 0; j < W; ++j) inv[j] = sum[j] > 0 ? T(1) / sum[j] : T(0);
      if (tgt != nullptr) {  // the item's heads' probabilities at each slot, summed: its share of the target
        V w{};
        for (int64_t lane = 0; lane < h.Gh; ++lane) w[lane] = inv[lane] / T(a.N1);
        T* row = tgt + ((t * a.N2 + n2) * a.HB + hb) * a.K;
        const V* si = s + i * KB;
        const int64_t* slot = sc.slot.data() + i * KB;
        for (int64_t j = 0; j < sc.count[i]; ++j) row[slot[j]] += sparseops_simd::hsum(si[j] * w);
      }
      T* o = out + (t * a.N1 + h.h0) * a.Dv;
      const V* oT = sc.oT.data() + i * Do;
      sparseops_simd::lanes_to_rows<T>(oT, h.Gh, a.Dv, inv, o, a.Dv);
      for (int64_t lane = 0; lane < h.Gh; ++lane) {
        m[t * a.N1 + h.h0 + lane] = sc.mx[i][lane];
        l[t * a.N1 + h.h0 + lane] = sum[lane];
      }
    }
  });
}

template <typename T>
void backward_tiles(const Args<T>& a, const T* dout, const T* lse, const T* out, T scale, T* dq, T* dk, T* dv,
                    int64_t P) {
  typedef typename Vec<T>::type V;
  const int64_t Do = std::max(a.D, a.Dv), WD = Vec<T>::W * a.D, WDv = Vec<T>::W * a.Dv, tile = tile_size(a);
  for_tiles(a, P, true, [&](int64_t it, int64_t tid, TileScratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t0 = it / (a.HB * a.N2) * tile;
    const int64_t t1 = std::min(a.T1, t0 + tile);
    const Heads<T> h(a.G, n2, hb);
    plan_tile(a, t0, t1, n2, sc);
    for (int64_t i = 0; i < t1 - t0; ++i) {
      const int64_t t = t0 + i;
      load_heads(a.q, t, a.N1, a.D, h, sc.xT.data() + i * a.D, sc.qN.data() + i * WD, a.qscale);
      load_heads(dout, t, a.N1, a.Dv, h, sc.yT.data() + i * a.Dv, sc.yN.data() + i * WDv, T(1));
      std::fill(sc.oT.begin() + i * Do, sc.oT.begin() + (i + 1) * Do, V{});
      V ls{}, dl{};  // dl: delta = rowsum(dO * O) of each head, from the dO rows just loaded
      const T* ob = out + (t * a.N1 + h.h0) * a.Dv;
      for (int64_t lane = 0; lane < h.Gh; ++lane) {
        ls[lane] = lse[t * a.N1 + h.h0 + lane];
        dl[lane] = dot<T>(sc.yN.data() + i * WDv + lane * a.Dv, ob + lane * a.Dv, a.Dv);
      }
      sc.ls[i] = ls;
      sc.dl[i] = dl;
    }
    T *dkt = dk + tid * a.R * a.D, *dvt = dv + tid * a.R * a.Dv;
    V* pb[2] = {sc.p.data(), sc.p.data() + KEY_BLOCK};  // p of each token of a unit
    V* db[2] = {sc.p.data() + 2 * KEY_BLOCK, sc.p.data() + 3 * KEY_BLOCK};  // dP, then dS
    for (const Unit& u : sc.units) {
      const int64_t n = u.n, tk[2] = {u.a, u.b};
      const int64_t* rows = sc.pool.data() + u.r0;
      const int nt = u.b < 0 ? 1 : 2;
      if (nt == 1) {
        row_scores<T>(sc.xT.data() + tk[0] * a.D, a.D, a.k, rows, n, a.D, pb[0]);
        row_scores<T>(sc.yT.data() + tk[0] * a.Dv, a.Dv, a.v, rows, n, a.Dv, db[0]);
      } else {
        row_scores2<T>(sc.xT.data() + tk[0] * a.D, sc.xT.data() + tk[1] * a.D, a.D, a.k, rows, n, a.D, pb[0], pb[1]);
        row_scores2<T>(sc.yT.data() + tk[0] * a.Dv, sc.yT.data() + tk[1] * a.Dv, a.Dv, a.v, rows, n, a.Dv, db[0],
                       db[1]);
      }
      for (int c = 0; c < nt; ++c)
        for (int64_t j = 0; j < n; ++j) {
          pb[c][j] = exp_clamped<T>(pb[c][j] - sc.ls[tk[c]], a.floor);
          db[c][j] = (db[c][j] - sc.dl[tk[c]]) * pb[c][j];
        }
      if (nt == 1) {
        row_combine<T>(db[0], a.k, rows, n, a.D, a.D, sc.oT.data() + tk[0] * Do);
        row_scatter<T>(db[0], sc.qN.data() + tk[0] * WD, h.Gh, a.D, dkt, rows, n);
        row_scatter<T>(pb[0], sc.yN.data() + tk[0] * WDv, h.Gh, a.Dv, dvt, rows, n);
      } else {
        row_combine2<T>(db[0], db[1], a.k, rows, n, a.D, a.D, sc.oT.data() + tk[0] * Do, sc.oT.data() + tk[1] * Do);
        row_scatter<T>(db[0], sc.qN.data() + tk[0] * WD, h.Gh, a.D, dkt, rows, n, db[1], sc.qN.data() + tk[1] * WD);
        row_scatter<T>(pb[0], sc.yN.data() + tk[0] * WDv, h.Gh, a.Dv, dvt, rows, n, pb[1],
                       sc.yN.data() + tk[1] * WDv);
      }
    }
    for (int64_t i = 0; i < t1 - t0; ++i) {
      T* g = dq + ((t0 + i) * a.N1 + h.h0) * a.D;
      const V* oT = sc.oT.data() + i * Do;
      sparseops_simd::lanes_to_rows<T>(oT, h.Gh, a.D, V{} + scale, g, a.D);
    }
  });
}

}  // namespace sparseops_attn
