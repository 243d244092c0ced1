use std::arch::x86_64::*;
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn run(reps: usize, a: &[u32], b: &[u32], kc: usize, mr: usize) -> f32 {
    let mut s = _mm512_setzero_ps();
    for _ in 0..reps {
        let mut acc = [[_mm512_setzero_ps(); 2]; 12];
        for p in 0..kc {
            let b0: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.as_ptr().add(p * 32) as *const _));
            let b1: __m512bh = std::mem::transmute(_mm512_loadu_si512(b.as_ptr().add(p * 32 + 16) as *const _));
            let ap = a.as_ptr().add(p * mr);
            for (i, row) in acc.iter_mut().enumerate() {
                let ai: __m512bh = std::mem::transmute(_mm512_set1_epi32(*ap.add(i) as i32));
                row[0] = _mm512_dpbf16_ps(row[0], ai, b0);
                row[1] = _mm512_dpbf16_ps(row[1], ai, b1);
            }
        }
        for r in acc { s = _mm512_add_ps(s, _mm512_add_ps(r[0], r[1])); }
    }
    _mm512_reduce_add_ps(s)
}
fn main() {
    let kc = 128;
    let a = vec![0u32; kc * 12];
    let b = vec![0u32; kc * 32];
    let reps = std::hint::black_box(200_000usize);
    let t = std::time::Instant::now();
    let r = unsafe { run(reps, &a, &b, kc, 12) };
    let dt = t.elapsed().as_secs_f64();
    let n = reps as f64 * kc as f64 * 24.0;
    println!("dpbf16 12x32 kernel: {:.3} ns per instr, {:.1} GFLOP/s/core {r}", dt * 1e9 / n, n * 64.0 / dt / 1e9);
}
