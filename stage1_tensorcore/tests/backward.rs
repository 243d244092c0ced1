//! The bf16 GEMM's backward (`bf16_gemm`'s `bwd`: dA = dC·Bᵀ, dB = Aᵀ·dC as bf16 GEMMs) against
//! candle's autograd: of the slow twin (the same bf16-rounded operands, an f32 GEMM: equal up to
//! the order of the f32 sums) and of the plain f32 matmul (bf16's rounding of the operands and
//! of dC apart), on ragged shapes, batched and broadcast.

use candle_core::{DType, Device, Tensor, Var};
use cpu_kernels::bf16_gemm::{self, Kernel};
use shared::weights::SplitMix64;

/// max |a − b| / max |b|.
fn rel_max(a: &Tensor, b: &Tensor) -> f32 {
    let v = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let (a, b) = (v(a), v(b));
    a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / b.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The gradients of ⟨f(a, b), r⟩ with respect to a and b.
fn grads(f: impl Fn(&Tensor, &Tensor) -> candle_core::Result<Tensor>, a: &Tensor, b: &Tensor, r: &Tensor) -> [Tensor; 2] {
    let (av, bv) = (Var::from_tensor(a).unwrap(), Var::from_tensor(b).unwrap());
    let c = f(av.as_tensor(), bv.as_tensor()).unwrap();
    assert_eq!(c.dims(), r.dims());
    let g = (c.to_dtype(DType::F32).unwrap() * r).unwrap().sum_all().unwrap().backward().unwrap();
    [g.get(av.as_tensor()).expect("a's gradient").clone(), g.get(bv.as_tensor()).expect("b's gradient").clone()]
}

#[test]
fn backward_matches_autograd_of_the_f32_matmul_on_ragged_shapes() {
    if !Kernel::detect().is_native() {
        eprintln!("no bf16 unit on this CPU: `matmul` runs its slow twin, candle ops, whose autograd is candle's");
    }
    let mut rng = SplitMix64::new(0xbac4);
    let mut normals = |dims: &[usize]| Tensor::from_vec(rng.normals(dims.iter().product()), dims, &Device::Cpu).unwrap();
    // (a's dims, b's dims): plain, K odd, a batched with b shared (a linear's (B·T, C) · Wᵀ as
    // attention's per-head products see it), both batched (q kᵀ, p v).
    let cases: [(&[usize], &[usize]); 5] = [
        (&[1, 1], &[1, 1]),
        (&[13, 37], &[37, 45]),
        (&[97, 129], &[129, 33]),
        (&[3, 17, 31], &[31, 40]),
        (&[2, 3, 19, 16], &[2, 3, 16, 19]),
    ];
    let mut worst = 0f32;
    for (ad, bd) in cases {
        let (a, b) = (normals(ad), normals(bd));
        let mut cd = ad.to_vec();
        *cd.last_mut().unwrap() = *bd.last().unwrap();
        let r = normals(&cd);
        // An f32 activation times a bf16 weight (stage 1's linears on the CPU), a transposed
        // view as the linears pass it, and two f32 operands through `matmul_bf16` (attention).
        let wt = b.to_dtype(DType::BF16).unwrap();
        for (what, bb) in [("f32 · bf16", wt), ("f32 · f32", b.clone())] {
            let ours = grads(if bb.dtype() == DType::BF16 { bf16_gemm::matmul } else { bf16_gemm::matmul_bf16 }, &a, &bb, &r);
            // The slow twin's steps, with candle's broadcast_matmul for a B shared across the batch.
            let wide = |t: &Tensor| t.to_dtype(DType::BF16)?.to_dtype(DType::F32);
            let twin = grads(|x, y| wide(x)?.broadcast_matmul(&wide(y)?), &a, &bb, &r);
            let f32_ref = grads(|x, y| x.broadcast_matmul(&y.to_dtype(DType::F32)?), &a, &bb, &r);
            for (i, name) in ["dA", "dB"].iter().enumerate() {
                assert_eq!(ours[i].dims(), [ad, bd][i], "{what} {ad:?}·{bd:?} {name}");
                assert_eq!(ours[i].dtype(), [&a, &bb][i].dtype(), "{name} in its argument's dtype");
                // vs the twin: the same products, the twin's dC not rounded to bf16 (≤ 2⁻⁹ each).
                let e_twin = rel_max(&ours[i], &twin[i]);
                let e_f32 = rel_max(&ours[i], &f32_ref[i]);
                assert!(e_twin <= 1e-2, "{what} {ad:?}·{bd:?} {name} vs the slow twin's autograd: {e_twin}");
                assert!(e_f32 <= 2e-2, "{what} {ad:?}·{bd:?} {name} vs the f32 matmul's autograd: {e_f32}");
                worst = worst.max(e_f32);
            }
        }
    }
    eprintln!("bf16 GEMM backward vs autograd of the f32 matmul: max |Δ| / max |g| = {worst:.2e}");
}
