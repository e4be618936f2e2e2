// The tile way through the keys of the C++ attention kernels (csrc/attention.cpp): an item is a tile of TILE
// consecutive query tokens of one KV head; each token's keys are cut into visits of at most KEY_BLOCK consecutive
// rows (cut at multiples of KEY_BLOCK positions, so that neighbours' visits coincide); two tokens' visits of the
// same rows run together as one unit (the products' *2 forms: each loaded key element serves both), units in the
// order of their rows, so that a row's key, value, dK and dV stay in the cache while the tile's tokens visit it.
#pragma once

#include "attention_items.h"
#include "attention_products.h"
#include "cpu.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace sparseops_attn {

// query tokens per tile item
constexpr int64_t TILE = 16;

// At most KEY_BLOCK consecutive key positions of one tile token: the flat rows row0 + i * N2 (i < n); tok: the
// token's index in the tile; off: where its scores start in the token's buffer (forward).
struct Visit {
  int64_t row0, n, tok, off;
};

// One unit of work: visit a, and visit b of another token over the same rows (-1: none).
struct Unit {
  int64_t a, b;
};

template <typename T> struct TileScratch {
  typedef typename Vec<T>::type V;
  std::vector<Visit> visits;
  std::vector<Unit> units;
  std::vector<int64_t> rows, count;
  std::vector<V> s, p, xT, yT, oT, ls, dl, mx, sum;
  std::vector<T> qN, yN;
  // KB: the most keys one token sees; bwd: the backward's buffers, else the forward's
  TileScratch(int64_t KB, int64_t D, int64_t Dv, bool bwd)
      : rows(KEY_BLOCK), count(TILE), s(bwd ? 0 : TILE * KB), p(bwd ? 4 * KEY_BLOCK : 0), xT(TILE * D),
        yT(bwd ? TILE * Dv : 0), oT(TILE * std::max(D, Dv)), ls(TILE), dl(TILE), mx(TILE), sum(TILE),
        qN(bwd ? TILE * Vec<T>::W * D : 0), yN(bwd ? TILE * Vec<T>::W * Dv : 0) {}
};

// The visits of tile tokens [t0, t1) at KV head n2 (cut at multiples of KEY_BLOCK positions, so that neighbours'
// visits coincide), sorted by rows, then paired: two visits of the same rows by different tokens form one unit.
template <typename T> void plan_tile(const Args<T>& a, int64_t t0, int64_t t1, int64_t n2, TileScratch<T>& sc) {
  auto& vs = sc.visits;
  vs.clear();
  auto add = [&](int64_t tok, int64_t base, int64_t p0, int64_t p1) {  // positions [p0, p1) of keys from row base
    while (p0 < p1) {
      const int64_t e = std::min(p1, (p0 / KEY_BLOCK + 1) * KEY_BLOCK);
      vs.push_back({(base + p0) * a.N2 + n2, e - p0, tok, 0});
      p0 = e;
    }
  };
  for (int64_t t = t0; t < t1; ++t) {
    if (a.topk == nullptr) {
      add(t - t0, 0, a.lo[t], a.hi[t]);
      continue;
    }
    const int64_t* ids = a.topk + (t * a.N2 + n2) * a.K;
    const int64_t lim = a.causal ? std::min(a.seq_len[t], a.pos[t] + 1) : a.seq_len[t];
    for (int64_t i = 0; i < a.K; ++i)
      if (ids[i] >= 0) add(t - t0, a.kv_start[t], ids[i] * a.bs, std::min(ids[i] * a.bs + a.bs, lim));
  }
  std::sort(vs.begin(), vs.end(), [](const Visit& x, const Visit& y) {
    return x.row0 != y.row0 ? x.row0 < y.row0 : x.n != y.n ? x.n < y.n : x.tok < y.tok;
  });
  sc.units.clear();
  std::vector<char> used(vs.size(), 0);
  std::fill(sc.count.begin(), sc.count.end(), 0);
  for (size_t i = 0; i < vs.size(); ++i) {
    if (used[i]) continue;
    int64_t b = -1;  // the next unused visit of the same rows by another token (a token's repeated block: not itself)
    for (size_t j = i + 1; j < vs.size() && vs[j].row0 == vs[i].row0 && vs[j].n == vs[i].n; ++j)
      if (!used[j] && vs[j].tok != vs[i].tok) {
        b = int64_t(j);
        break;
      }
    used[i] = 1;
    if (b >= 0) used[b] = 1;
    sc.units.push_back({int64_t(i), b});
    for (int64_t x : {int64_t(i), b})
      if (x >= 0) {
        vs[x].off = sc.count[vs[x].tok];
        sc.count[vs[x].tok] += vs[x].n;
      }
  }
}

// The flat rows of a visit.
inline const int64_t* visit_rows(const Visit& v, int64_t N2, std::vector<int64_t>& rows) {
  for (int64_t i = 0; i < v.n; ++i) rows[i] = v.row0 + i * N2;
  return rows.data();
}

// Runs fn(item, task, scratch) for every tile item (tile, n2, hb), dealt round-robin to P tasks, one thread each.
template <typename T, typename F> void for_tiles(const Args<T>& a, int64_t P, bool bwd, F fn) {
  const int64_t items = (a.T1 + TILE - 1) / TILE * a.N2 * a.HB;
  sparseops_simd::run_tasks(P, [&](int64_t tid) {
    TileScratch<T> sc(a.K * a.bs, a.D, a.Dv, bwd);
    for (int64_t it = tid; it < items; it += P) fn(it, tid, sc);
  });
}

template <typename T> void forward_tiles(const Args<T>& a, T* out, T* m, T* l, int64_t P) {
  typedef typename Vec<T>::type V;
  constexpr int W = Vec<T>::W;
  const int64_t KB = a.K * a.bs, Do = std::max(a.D, a.Dv);
  for_tiles(a, P, false, [&](int64_t it, int64_t, TileScratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t0 = it / (a.HB * a.N2) * TILE;
    const int64_t t1 = std::min(a.T1, t0 + TILE);
    const Heads<T> h(a.G, n2, hb);
    plan_tile(a, t0, t1, n2, sc);
    for (int64_t i = 0; i < t1 - t0; ++i) {
      load_heads(a.q, t0 + i, a.N1, a.D, h, sc.xT.data() + i * a.D, static_cast<T*>(nullptr), a.qscale);
      std::fill(sc.oT.begin() + i * Do, sc.oT.begin() + (i + 1) * Do, V{});
    }
    auto S = [&](const Visit& v) { return sc.s.data() + v.tok * KB + v.off; };
    for (const Unit& u : sc.units) {  // scores
      const Visit& x = sc.visits[u.a];
      const int64_t* rows = visit_rows(x, a.N2, sc.rows);
      if (u.b < 0) {
        row_scores<T>(sc.xT.data() + x.tok * a.D, a.D, a.k, rows, x.n, a.D, S(x));
      } else {
        const Visit& y = sc.visits[u.b];
        row_scores2<T>(sc.xT.data() + x.tok * a.D, sc.xT.data() + y.tok * a.D, a.D, a.k, rows, x.n, a.D, S(x), S(y));
      }
    }
    for (int64_t i = 0; i < t1 - t0; ++i) {
      sc.sum[i] = sc.mx[i] = V{};  // a token that sees no key: out, m, l are 0
      if (sc.count[i] > 0) sc.sum[i] = softmax_terms<T>(sc.s.data() + i * KB, sc.count[i], a.floor, sc.mx[i]);
    }
    for (const Unit& u : sc.units) {  // P V
      const Visit& x = sc.visits[u.a];
      const int64_t* rows = visit_rows(x, a.N2, sc.rows);
      if (u.b < 0) {
        row_combine<T>(S(x), a.v, rows, x.n, a.Dv, a.Dv, sc.oT.data() + x.tok * Do, true);
      } else {
        const Visit& y = sc.visits[u.b];
        row_combine2<T>(S(x), S(y), a.v, rows, x.n, a.Dv, a.Dv, sc.oT.data() + x.tok * Do, sc.oT.data() + y.tok * Do);
      }
    }
    for (int64_t i = 0; i < t1 - t0; ++i) {
      const int64_t t = t0 + i;
      const V sum = sc.sum[i];
      V inv;
      for (int j = 0; j < W; ++j) inv[j] = sum[j] > 0 ? T(1) / sum[j] : T(0);
      T* o = out + (t * a.N1 + h.h0) * a.Dv;
      const V* oT = sc.oT.data() + i * Do;
      for (int64_t lane = 0; lane < h.Gh; ++lane) {
        for (int64_t d = 0; d < a.Dv; ++d) o[lane * a.Dv + d] = oT[d][lane] * inv[lane];
        m[t * a.N1 + h.h0 + lane] = sc.mx[i][lane];
        l[t * a.N1 + h.h0 + lane] = sum[lane];
      }
    }
  });
}

template <typename T>
void backward_tiles(const Args<T>& a, const T* dout, const T* lse, const T* out, T scale, T* dq, T* dk, T* dv,
                    int64_t rows_kv, int64_t P) {
  typedef typename Vec<T>::type V;
  const int64_t Do = std::max(a.D, a.Dv), WD = Vec<T>::W * a.D, WDv = Vec<T>::W * a.Dv;
  for_tiles(a, P, true, [&](int64_t it, int64_t tid, TileScratch<T>& sc) {
    const int64_t hb = it % a.HB, n2 = (it / a.HB) % a.N2, t0 = it / (a.HB * a.N2) * TILE;
    const int64_t t1 = std::min(a.T1, t0 + TILE);
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
    T *dkt = dk + tid * rows_kv * a.D, *dvt = dv + tid * rows_kv * a.Dv;
    V* pb[2] = {sc.p.data(), sc.p.data() + KEY_BLOCK};  // p of each token of a unit
    V* db[2] = {sc.p.data() + 2 * KEY_BLOCK, sc.p.data() + 3 * KEY_BLOCK};  // dP, then dS
    for (const Unit& u : sc.units) {
      const Visit& x = sc.visits[u.a];
      const int64_t n = x.n, tk[2] = {x.tok, u.b < 0 ? -1 : sc.visits[u.b].tok};
      const int64_t* rows = visit_rows(x, a.N2, sc.rows);
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
        row_combine<T>(db[0], a.k, rows, n, a.D, a.D, sc.oT.data() + tk[0] * Do, true);
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
      for (int64_t lane = 0; lane < h.Gh; ++lane)
        for (int64_t d = 0; d < a.D; ++d) g[lane * a.D + d] = oT[d][lane] * scale;
    }
  });
}

}  // namespace sparseops_attn
