//! Unit tests of `shared/src/ceiling.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::preset::Preset;

/// The block's four linears: (name, m, n, k).
fn block_gemms(s: &Shape) -> Vec<(&'static str, usize, usize, usize)> {
    probe_gemms(s)[..4].iter().map(|g| (g.name, g.m, g.n, g.k)).collect()
}

#[test]
fn shapes_are_the_blocks_linears() {
    // small: B·T = 2048, C = 768, FF = 3072
    let g = block_gemms(&Preset::Small.shape());
    assert_eq!(g, [("qkv", 2048, 2304, 768), ("proj", 2048, 768, 768), ("fc1", 2048, 3072, 768), ("fc2", 2048, 768, 3072)]);
    // together they are the linears' share of block_flops
    let s = Preset::Tiny.shape();
    let linears: f64 = block_gemms(&s).iter().map(|&(_, m, n, k)| 2.0 * (m * n * k) as f64).sum();
    let attention = 2.0 * (s.batch * s.seq * s.seq * s.d_model) as f64;
    assert_eq!(linears + attention, crate::perf::block_flops(&s));
}

// The probe's bytes come from the shapes it measures, and a probe that cannot fit is exit 2
// before it allocates anything.
#[test]
fn probe_bytes_count_its_widest_gemm_and_refuse_before_allocating() {
    let s = Preset::Small.shape();
    let widest = block_gemms(&s).iter().map(|&(_, m, n, k)| 4 * (m * k + n * k + m * n) as u128).max().unwrap();
    assert_eq!(widest, 4 * (2048 * 768 + 3072 * 768 + 2048 * 3072), "fc1 (and fc2) on small");
    assert_eq!(probe_bytes(&s), widest.max(3 * TRIAD_ARRAY_BYTES as u128));
    // ~42 GB for fc1 alone: more than this process has, refused at once (not an abort).
    let huge = Shape { batch: 1, seq: 80_000, d_model: 26_000, n_head: 1000, ff: 80_000 };
    let e = check_fit(&huge).unwrap_err().to_string();
    assert!(e.contains("ceiling probe") && e.contains("memory") && e.contains("Fix:"), "{e}");
    assert!(check_fit(&Preset::Tiny.shape()).is_ok());
}

#[test]
fn probe_shapes_add_attentions_products_and_the_ceiling_weighs_them() {
    let s = Preset::Small.shape(); // B = 4, T = 512, n_head = 12, d_head = 64
    let g = probe_gemms(&s);
    assert_eq!(g.len(), 6);
    assert_eq!(g[4], ProbeGemm { name: "attn_qk", batch: 48, m: 512, n: 512, k: 64 });
    assert_eq!(g[5], ProbeGemm { name: "attn_pv", batch: 48, m: 512, n: 64, k: 512 });
    // Long T: fewer heads, and T capped, so the score tensor stays within its budget.
    for seq in [4096, 100_000] {
        let qk = probe_gemms(&Shape { seq, ..s })[4];
        assert!(qk.batch >= 1 && qk.m == seq.min(4096) && qk.batch * qk.m * qk.n <= ATTENTION_PROBE_SCORES, "{qk:?}");
    }
    // The ceiling: linears at 100 GFLOP/s and attention's shapes at 25 give the block's
    // FLOPs over (linear FLOPs / 100 + attention FLOPs / 25).
    let rate = |p: &ProbeGemm, r: f64| GemmRate { name: p.name.into(), batch: p.batch, m: p.m, n: p.n, k: p.k, gflops: r };
    let rates: Vec<GemmRate> = g.iter().map(|p| rate(p, if p.name.starts_with("attn") { 25.0 } else { 100.0 })).collect();
    let linears: f64 = block_gemms(&s).iter().map(|&(_, m, n, k)| 2.0 * (m * n * k) as f64).sum();
    let attention = crate::perf::block_flops(&s) - linears;
    let want = (linears + attention) / (linears / 100e9 + attention / 25e9) / 1e9;
    assert!((block_ceiling_gflops(&s, &rates) - want).abs() < 1e-9 * want);
    assert!((block_ceiling_gflops(&s, &rates[..4]) - 100.0).abs() < 1e-9, "linears alone: their rate");
}

#[test]
fn tiny_probe_measures_something_finite() {
    let _alone = crate::BIG_ALLOCATION_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let c = measure(&Preset::Tiny.shape()).unwrap();
    assert_eq!(c.gemms.len(), 6);
    assert_eq!(c.gemms[4].name, "attn_qk");
    assert!(c.gemms.iter().all(|g| g.gflops.is_finite() && g.gflops > 0.0));
    assert!(c.gemm_gflops.is_finite() && c.gemm_gflops > 0.0 && c.bandwidth_gbs > 0.0);
    assert_eq!(c.gemm_backend, gemm_backend());
    let json = serde_json::to_string(&c).unwrap();
    let back: CpuCeiling = serde_json::from_str(&json).unwrap(); // the JSON a reader (the roofline) gets
    assert_eq!((back.gemms.len(), back.gemm_backend, back.simd), (6, c.gemm_backend.clone(), c.simd.clone()));
    // A record written before attention shapes were measured (no `batch`) still reads.
    let old: GemmRate = serde_json::from_str(r#"{"name":"qkv","m":2,"n":3,"k":4,"gflops":1.0}"#).unwrap();
    assert_eq!(old.batch, 1);
}
