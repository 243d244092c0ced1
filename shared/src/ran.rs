//! What a forward ran, read from the forward itself: the dtypes of the tensors each part takes in
//! (`breakdown::enter`) and the kernels each code path named as it executed
//! (`cpu_kernels::trace`, the source of `--breakdown`'s `kernels` too). The runner observes the
//! checked forward and writes the row's notes from it (`notes`), so a note says what ran, not
//! what a stage's flags meant to run.

use candle_core::{DType, Result};
use std::cell::RefCell;

/// One part of an observed forward.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RanPart {
    pub name: String,
    /// The dtypes of the tensors the part took in (`breakdown::enter`), each once, in order;
    /// empty for a part marked with `breakdown::part` alone.
    pub inputs: Vec<DType>,
    /// The kernels the part ran, "name ×n" where one ran n > 1 times, in first-run order.
    pub kernels: Vec<String>,
}

thread_local! {
    static OBSERVED: RefCell<Option<Vec<RanPart>>> = const { RefCell::new(None) };
}

/// Part `name` begins (called by `breakdown::part`): the kernels since the last boundary were
/// the previous part's.
pub(crate) fn boundary(name: &str) {
    OBSERVED.with(|o| {
        if let Some(parts) = o.borrow_mut().as_mut() {
            let ran = cpu_kernels::trace::take();
            if let Some(last) = parts.last_mut() {
                last.kernels.extend(ran);
            }
            parts.push(RanPart { name: name.into(), ..Default::default() });
        }
    });
}

/// The part just begun takes tensors of these dtypes (called by `breakdown::enter`).
pub(crate) fn inputs(dtypes: impl IntoIterator<Item = DType>) {
    OBSERVED.with(|o| {
        if let Some(part) = o.borrow_mut().as_mut().and_then(|p| p.last_mut()) {
            for d in dtypes {
                if !part.inputs.contains(&d) {
                    part.inputs.push(d);
                }
            }
        }
    });
}

/// Run `forward` once, observed: its result and what each of its parts ran. Kernels that ran
/// before the first part (or in a forward that marks none) go under a part named "forward".
pub fn observe<T>(forward: impl FnOnce() -> Result<T>) -> Result<(T, Vec<RanPart>)> {
    OBSERVED.with(|o| *o.borrow_mut() = Some(vec![RanPart { name: "forward".into(), ..Default::default() }]));
    cpu_kernels::trace::start();
    let y = forward();
    let tail = cpu_kernels::trace::stop();
    let mut parts = OBSERVED.with(|o| o.borrow_mut().take()).unwrap_or_default();
    if let Some(last) = parts.last_mut() {
        last.kernels.extend(tail);
    }
    parts.retain(|p| p.name != "forward" || !p.kernels.is_empty());
    for p in &mut parts {
        p.kernels = crate::breakdown::group(std::mem::take(&mut p.kernels));
    }
    Ok((y?, parts))
}

/// "bf16", "f32", ...
pub fn dtype_name(d: DType) -> String {
    format!("{d:?}").to_lowercase()
}

/// A kernel's name without its run count ("gemm f32: candle matmul ×4" → "gemm f32: candle matmul").
fn kernel_name(k: &str) -> &str {
    match k.rsplit_once(" ×") {
        Some((name, n)) if n.parse::<usize>().is_ok() => name,
        _ => k,
    }
}

/// Whether a kernel is a matrix multiplication: the engine's and candle's GEMMs ("gemm …"), FP8's
/// ("fp8 gemm: …") and the fused linears that run one with their epilogue ("fused linear: …").
pub fn is_gemm(kernel: &str) -> bool {
    ["gemm", "fp8 gemm", "fused linear", "linear"].iter().any(|p| kernel.starts_with(p))
}

/// Whether a kernel is element-wise work: a pass of the engine's or candle's (add, cast,
/// LayerNorm, GELU), a fused LayerNorm, or an FP8 quantisation.
pub fn is_elementwise(kernel: &str) -> bool {
    ["add:", "cast:", "layer_norm:", "gelu:", "fused layer_norm", "fused add+layer_norm", "fp8:", "fp8 producer"]
        .iter()
        .any(|p| kernel.starts_with(p))
}

/// Each distinct kernel that `pick` keeps, in first-run order, with the parts it ran in.
fn by_kernel(parts: &[RanPart], pick: impl Fn(&RanPart, &str) -> bool) -> Vec<(String, Vec<String>)> {
    let mut out: Vec<(String, Vec<String>)> = Vec::new();
    for p in parts {
        for k in p.kernels.iter().map(|k| kernel_name(k)).filter(|k| pick(p, k)) {
            match out.iter_mut().find(|(name, _)| name == k) {
                Some((_, at)) if !at.contains(&p.name) => at.push(p.name.clone()),
                Some(_) => {}
                None => out.push((k.to_string(), vec![p.name.clone()])),
            }
        }
    }
    out
}

/// The row's notes from an observed forward: the activations' dtypes by part, the GEMM kernels
/// and the attention kernel, each as the forward ran it. Empty when nothing was observed (a CUDA
/// graph's replay runs no code path that could name itself).
pub fn notes(parts: &[RanPart]) -> Vec<String> {
    if parts.iter().all(|p| p.kernels.is_empty() && p.inputs.is_empty()) {
        return Vec::new();
    }
    let mut notes = Vec::new();
    let mut dtypes: Vec<(DType, Vec<&str>)> = Vec::new();
    for p in parts {
        for d in &p.inputs {
            match dtypes.iter_mut().find(|(x, _)| x == d) {
                Some((_, at)) => at.push(&p.name),
                None => dtypes.push((*d, vec![&p.name])),
            }
        }
    }
    if !dtypes.is_empty() {
        let each: Vec<String> = dtypes.iter().map(|(d, at)| format!("{} into {}", dtype_name(*d), at.join(", "))).collect();
        notes.push(format!("ran: activations {}", each.join("; ")));
    }
    let list = |kernels: Vec<(String, Vec<String>)>| -> String {
        kernels.iter().map(|(k, at)| format!("{k} ({})", at.join(", "))).collect::<Vec<_>>().join("; ")
    };
    let gemms = by_kernel(parts, |_, k| is_gemm(k));
    if !gemms.is_empty() {
        notes.push(format!("ran: GEMMs by kernel: {}", list(gemms)));
    }
    let attention = by_kernel(parts, |p, k| p.name == "attention" && !is_gemm(k) && !is_elementwise(k));
    if !attention.is_empty() {
        let names: Vec<String> = attention.into_iter().map(|(k, _)| k.strip_prefix("attention: ").unwrap_or(&k).to_string()).collect();
        notes.push(format!("ran: attention kernel {}", names.join("; ")));
    }
    notes
}

#[cfg(test)]
#[path = "../tests/unit/ran.rs"]
mod tests;
