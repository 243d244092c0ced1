//! The block's parameters: made from a seed on the host (so every device computes the same
//! function), or read from / written to a safetensors file in GPT-2's layer naming.
//!
//! Recipe (fixed, so a seed names one block forever): each tensor draws from its own SplitMix64
//! stream seeded by `mix(seed, name)`, N(0, 1) by Box–Muller in f64, scaled to N(0, 0.02²) (LayerNorm
//! gains 1 + N(0, 0.02²)); x is N(0, 1) from the stream "x". Changing FF leaves W_qkv as it was.

use crate::error::SpeedkitError;
use crate::preset::Shape;
use candle_core::{DType, Device, Tensor};
use safetensors::{tensor::TensorView, Dtype, SafeTensors};
use std::collections::HashMap;
use std::path::Path;

/// f32 parameters, matrices (out_features, in_features).
#[derive(Clone, Debug)]
pub struct BlockWeights {
    pub ln1_g: Tensor,  // (C)
    pub ln1_b: Tensor,  // (C)
    pub w_qkv: Tensor,  // (3C, C): rows 0..C make q, C..2C k, 2C..3C v
    pub b_qkv: Tensor,  // (3C)
    pub w_proj: Tensor, // (C, C)
    pub b_proj: Tensor, // (C)
    pub ln2_g: Tensor,  // (C)
    pub ln2_b: Tensor,  // (C)
    pub w_fc1: Tensor,  // (FF, C)
    pub b_fc1: Tensor,  // (FF)
    pub w_fc2: Tensor,  // (C, FF)
    pub b_fc2: Tensor,  // (C)
}

/// A deterministic, platform-independent generator (SplitMix64, Steele et al. 2014).
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1], from the top 53 bits.
    fn next_unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) + 1) as f64 / (1u64 << 53) as f64
    }

    /// `n` samples of N(0, 1) (Box–Muller; both outputs of each pair are used).
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        let mut out = Vec::with_capacity(n + 1);
        while out.len() < n {
            let (r, theta) = ((-2.0 * self.next_unit().ln()).sqrt(), 2.0 * std::f64::consts::PI * self.next_unit());
            out.extend([(r * theta.cos()) as f32, (r * theta.sin()) as f32]);
        }
        out.truncate(n);
        out
    }
}

/// N(mean, std²) from the stream of one named tensor: FNV-1a of the name, mixed with the seed.
fn normal_tensor(seed: u64, name: &str, dims: &[usize], mean: f32, std: f32) -> candle_core::Result<Tensor> {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3));
    let mut stream = SplitMix64::new(SplitMix64::new(seed ^ h).next_u64());
    let v: Vec<f32> = stream.normals(dims.iter().product()).into_iter().map(|z| mean + std * z).collect();
    Tensor::from_vec(v, dims, &Device::Cpu)
}

pub fn random_input(shape: &Shape, seed: u64) -> candle_core::Result<Tensor> {
    normal_tensor(seed, "x", &[shape.batch, shape.seq, shape.d_model], 0.0, 1.0)
}

/// GPT-2 names of one layer's tensors, in the order of `BlockWeights`' fields.
#[rustfmt::skip]
const GPT2_NAMES: [&str; 12] = [
    "ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
];

/// The shapes of `GPT2_NAMES`: GPT-2's Conv1D matrices are (in, out), ours transposed.
fn gpt2_shapes(c: usize, ff: usize) -> [Vec<usize>; 12] {
    [vec![c], vec![c], vec![c, 3 * c], vec![3 * c], vec![c, c], vec![c], vec![c], vec![c], vec![c, ff], vec![ff], vec![ff, c], vec![c]]
}

/// Where we record n_head (GPT-2 files do not carry it).
const META_N_HEAD: &str = "n_head";

impl BlockWeights {
    /// The recipe above, each field's stream named by the field (`train::NAMES`).
    pub fn from_seed(shape: &Shape, seed: u64) -> candle_core::Result<Self> {
        let t = crate::train::NAMES.into_iter().zip(gpt2_shapes(shape.d_model, shape.ff)).map(|(name, mut dims)| {
            dims.reverse(); // GPT-2's (in, out) to ours
            normal_tensor(seed, name, &dims, if name.ends_with("_g") { 1.0 } else { 0.0 }, 0.02)
        });
        Ok(Self::from_tensors(t.collect::<candle_core::Result<Vec<_>>>()?.try_into().expect("twelve tensors")))
    }

    /// (C, FF), read off W_fc1 (FF, C).
    pub fn dims(&self) -> (usize, usize) {
        let [ff, c] = *self.w_fc1.dims() else { return (0, 0) };
        (c, ff)
    }

    pub fn tensors(&self) -> [&Tensor; 12] {
        let w = self;
        [&w.ln1_g, &w.ln1_b, &w.w_qkv, &w.b_qkv, &w.w_proj, &w.b_proj, &w.ln2_g, &w.ln2_b, &w.w_fc1, &w.b_fc1, &w.w_fc2, &w.b_fc2]
    }

    pub fn from_tensors(t: [Tensor; 12]) -> Self {
        let [ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2] = t;
        BlockWeights { ln1_g, ln1_b, w_qkv, b_qkv, w_proj, b_proj, ln2_g, ln2_b, w_fc1, b_fc1, w_fc2, b_fc2 }
    }

    pub fn to_device(&self, device: &Device) -> candle_core::Result<Self> {
        let t: Vec<Tensor> = self.tensors().iter().map(|t| t.to_device(device)).collect::<candle_core::Result<_>>()?;
        Ok(Self::from_tensors(t.try_into().expect("twelve tensors")))
    }

    /// Write as layer `layer` of a GPT-2 checkpoint (Conv1D layout), with n_head in the metadata.
    pub fn save_gpt2(&self, path: &Path, layer: usize, n_head: usize) -> anyhow::Result<()> {
        let named = self.tensors().into_iter().zip(GPT2_NAMES).map(|(t, name)| {
            let t = if t.rank() == 2 { t.t()? } else { t.clone() };
            Ok((format!("h.{layer}.{name}"), t))
        });
        let meta = HashMap::from([(META_N_HEAD.to_string(), n_head.to_string())]);
        save("--save-weights", path, named.collect::<candle_core::Result<_>>()?, Some(meta))
    }

    /// One layer of a GPT-2-named safetensors file (`h.N.*`, maybe prefixed: `transformer.h.N.*`),
    /// and n_head if the file records it. `layer: None`: the file's only layer.
    pub fn load_gpt2(path: &Path, layer: Option<usize>) -> Result<(Self, Option<usize>), SpeedkitError> {
        let bad = |why: String| {
            SpeedkitError::usage(format!(
                "cannot use weights file {}: {why}. Fix: pass a safetensors file holding one GPT-2 layer \
                 (h.N.ln_1.weight, h.N.attn.c_attn.weight, ...; e.g. one written by --save-weights) \
                 and pick the layer with --layer N.",
                path.display()
            ))
        };
        let bytes = read_file(path).map_err(&bad)?;
        let (st, meta) = parse(&bytes).map_err(&bad)?;
        let names = st.names();
        let layers: Vec<usize> = names.iter().filter_map(|k| layer_of(k)).collect::<std::collections::BTreeSet<_>>().into_iter().collect();
        let layer = match (layer, layers.as_slice()) {
            (_, []) => return Err(bad("it holds no GPT-2 layer (no key like h.0.ln_1.weight)".into())),
            (Some(l), ls) if !ls.contains(&l) => return Err(bad(format!("it has no layer {l} (layers present: {ls:?})"))),
            (Some(l), _) => l,
            (None, [only]) => *only,
            (None, ls) => return Err(bad(format!("it holds {} layers ({ls:?}) and --layer was not given", ls.len()))),
        };
        let find = |name: &str| {
            let suffix = format!("h.{layer}.{name}");
            let key = names.iter().find(|k| **k == suffix || k.ends_with(&format!(".{suffix}")));
            let key = key.ok_or_else(|| bad(format!("tensor {suffix} is missing")))?;
            Ok::<_, SpeedkitError>((key.to_string(), st.tensor(key).map_err(|e| bad(format!("tensor {key}: {e}")))?))
        };
        let dim0 = |name| find(name).map(|(_, v)| v.shape().first().copied().unwrap_or(0));
        let (c, ff) = (dim0("ln_1.weight")?, dim0("mlp.c_fc.bias")?);
        if c == 0 || ff == 0 {
            return Err(bad("ln_1.weight or mlp.c_fc.bias is empty".into()));
        }
        let mut tensors = Vec::with_capacity(12);
        for (name, want) in GPT2_NAMES.into_iter().zip(gpt2_shapes(c, ff)) {
            let (key, view) = find(name)?;
            if view.shape() != want {
                let matrix = if want.len() == 2 { " (a weight matrix: 2 dimensions)" } else { "" };
                return Err(bad(format!("tensor {key} has shape {:?}, but C = {c} and FF = {ff} need {want:?}{matrix}", view.shape())));
            }
            let t = view_to_f32(&view).map_err(|e| bad(format!("tensor {key}: {e}")))?;
            let t = if t.rank() == 2 { t.t().and_then(|t| t.contiguous()) } else { Ok(t) };
            tensors.push(t.map_err(|e| bad(format!("tensor {key}: {e}")))?);
        }
        // n_head is ours (--save-weights writes it): when present it must be a positive integer dividing C.
        let heads = meta.as_ref().and_then(|m| m.get(META_N_HEAD));
        let n_head = heads.map(|v| v.trim().parse::<usize>().ok().filter(|&h| h > 0 && c % h == 0).ok_or(v)).transpose().map_err(|v| {
            let v: String = v.chars().take(100).collect(); // a file's string, shown bounded
            bad(format!("its metadata {META_N_HEAD} = {v:?} is not a positive integer dividing C = {c} (correct or drop the key)"))
        })?;
        Ok((Self::from_tensors(tensors.try_into().expect("twelve tensors")), n_head))
    }
}

/// The N of a key like "h.N.ln_1.weight" or "transformer.h.N.ln_1.weight".
fn layer_of(key: &str) -> Option<usize> {
    let rest = key.strip_suffix(".ln_1.weight")?;
    let idx = rest.rfind("h.")?;
    (idx == 0 || rest[..idx].ends_with('.')).then(|| rest[idx + 2..].parse().ok()).flatten()
}

/// Read a file whole, refusing one larger than half the memory available.
fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("it cannot be read ({e})"))?;
    // A FIFO would block and a device (/dev/zero) read forever.
    if !meta.is_file() {
        return Err("it is not a regular file".into());
    }
    let len = meta.len();
    if let Some(avail) = crate::device::available_bytes(&Device::Cpu).filter(|&a| len > a / 2) {
        return Err(format!("it is {len} bytes, more than half the {avail} bytes of memory available to read it into"));
    }
    std::fs::read(path).map_err(|e| format!("it cannot be read ({e})"))
}

fn parse(bytes: &[u8]) -> Result<(SafeTensors<'_>, Option<HashMap<String, String>>), String> {
    let not = |e| format!("it is not a safetensors file ({e})");
    // The header is read into a map, where a repeated key silently keeps its last entry: a tensor
    // named twice is two claims on one name, and which is meant cannot be told.
    if let Some(key) = duplicate_key(bytes) {
        return Err(format!("its header names {key:?} twice (each tensor name may appear once; which entry is meant cannot be told)"));
    }
    let (_, header) = SafeTensors::read_metadata(bytes).map_err(not)?;
    Ok((SafeTensors::deserialize(bytes).map_err(not)?, header.metadata().clone()))
}

/// The first key a safetensors header's JSON object holds twice; `None` when none is (or the
/// header is not a JSON object: `SafeTensors::deserialize` then says what is wrong).
fn duplicate_key(bytes: &[u8]) -> Option<String> {
    use serde::de::{IgnoredAny, MapAccess, Visitor};
    struct FirstRepeat;
    impl<'de> Visitor<'de> for FirstRepeat {
        type Value = Option<String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Option<String>, A::Error> {
            let mut seen = std::collections::HashSet::new();
            while let Some(key) = map.next_key::<String>()? {
                map.next_value::<IgnoredAny>()?;
                if !seen.insert(key.clone()) {
                    return Ok(Some(key));
                }
            }
            Ok(None)
        }
    }
    let len = usize::try_from(u64::from_le_bytes(bytes.get(..8)?.try_into().ok()?)).ok()?;
    let header = bytes.get(8..8usize.checked_add(len)?)?;
    serde::Deserializer::deserialize_map(&mut serde_json::Deserializer::from_slice(header), FirstRepeat).ok().flatten()
}

/// A tensor of the file as f32, refusing NaN or infinity (bad input, not a failed check).
fn view_to_f32(view: &TensorView<'_>) -> Result<Tensor, String> {
    use candle_core::safetensors::Load;
    if !matches!(view.dtype(), Dtype::F32 | Dtype::F64 | Dtype::F16 | Dtype::BF16) {
        return Err(format!("dtype {:?} is not a float type (need F32, F16, BF16 or F64)", view.dtype()));
    }
    let t = view.load(&Device::Cpu).and_then(|t| t.to_dtype(DType::F32)).map_err(|e| e.to_string())?;
    let v: Vec<f32> = t.flatten_all().and_then(|t| t.to_vec1()).map_err(|e| e.to_string())?;
    if let Some(flat) = v.iter().position(|x| !x.is_finite()) {
        // Flat position -> index in the file's own dims (Conv1D: (in, out)), e.g. [3, 17].
        let dims = view.shape();
        let index: Vec<usize> = dims.iter().enumerate().map(|(i, d)| flat / dims[i + 1..].iter().product::<usize>() % d).collect();
        let count = v.iter().filter(|x| !x.is_finite()).count();
        return Err(format!(
            "holds {} at index {index:?} (the first of {count} NaN or infinite values; the block needs finite numbers, so replace them)",
            v[flat]
        ));
    }
    Ok(t)
}

/// The input x (B, T, C) of a safetensors file: the tensor "x", or its only one, as f32.
pub fn load_input(path: &Path) -> Result<Tensor, SpeedkitError> {
    let bad = |why: String| {
        SpeedkitError::usage(format!(
            "cannot use input file {}: {why}. Fix: pass a safetensors file with one tensor \"x\" of shape (B, T, C).",
            path.display()
        ))
    };
    let bytes = read_file(path).map_err(&bad)?;
    let (st, _) = parse(&bytes).map_err(&bad)?;
    let names = st.names();
    let key = match names.as_slice() {
        _ if names.contains(&"x") => "x",
        [only] => only,
        _ => return Err(bad(format!("it has no tensor named \"x\" and {} tensors", names.len()))),
    };
    let view = st.tensor(key).map_err(|e| bad(e.to_string()))?;
    if view.shape().len() != 3 || view.shape().contains(&0) {
        return Err(bad(format!("tensor {key} has shape {:?}, not (B, T, C) with every dimension at least 1", view.shape())));
    }
    view_to_f32(&view).map_err(|e| bad(format!("tensor {key} {e}")))
}

pub fn save_tensors(path: &Path, tensors: &[(&str, &Tensor)]) -> anyhow::Result<()> {
    save("--save-output", path, tensors.iter().map(|(n, t)| (n.to_string(), (*t).clone())).collect(), None)
}

fn save(flag: &str, path: &Path, tensors: Vec<(String, Tensor)>, meta: Option<HashMap<String, String>>) -> anyhow::Result<()> {
    let on_host = |(n, t): (String, Tensor)| Ok((n, t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?));
    let host = tensors.into_iter().map(on_host).collect::<candle_core::Result<Vec<_>>>()?;
    Ok(crate::output::write(flag, path, &safetensors::serialize(host, meta)?)?)
}

#[cfg(test)]
#[path = "../tests/unit/weights.rs"]
mod tests;
