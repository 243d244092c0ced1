//! Unit tests of `shared/src/weights.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;
use crate::preset::Preset;

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn same_seed_same_weights_other_seed_other_weights() {
    let s = Preset::Tiny.shape();
    let (a, b, c) =
        (BlockWeights::from_seed(&s, 7).unwrap(), BlockWeights::from_seed(&s, 7).unwrap(), BlockWeights::from_seed(&s, 8).unwrap());
    for ((x, y), z) in a.tensors().iter().zip(b.tensors()).zip(c.tensors()) {
        assert_eq!(flat(x), flat(y));
        assert_ne!(flat(x), flat(z));
    }
}

#[test]
fn recipe_statistics() {
    let s = Preset::Small.shape();
    let w = BlockWeights::from_seed(&s, 0).unwrap();
    let v = flat(&w.w_fc1);
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!(mean.abs() < 1e-4 && (std - 0.02).abs() < 2e-4, "mean {mean} std {std}");
    let g = flat(&w.ln1_g);
    let gm = g.iter().sum::<f32>() / g.len() as f32;
    assert!((gm - 1.0).abs() < 0.005, "{gm}");
}

#[test]
fn per_tensor_streams_make_qkv_independent_of_ff() {
    let mut s = Preset::Tiny.shape();
    let a = BlockWeights::from_seed(&s, 3).unwrap();
    s.ff = 256;
    let b = BlockWeights::from_seed(&s, 3).unwrap();
    assert_eq!(flat(&a.w_qkv), flat(&b.w_qkv));
}

#[test]
fn gpt2_round_trip_and_layout() {
    let s = Preset::Tiny.shape();
    let w = BlockWeights::from_seed(&s, 1).unwrap();
    let dir = std::env::temp_dir().join(format!("speedkit-w-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("layer.safetensors");
    w.save_gpt2(&p, 5, 4).unwrap();
    // GPT-2 stores c_attn.weight as (C, 3C): our (3C, C) transposed.
    let raw = candle_core::safetensors::load(&p, &Device::Cpu).unwrap();
    assert_eq!(raw["h.5.attn.c_attn.weight"].dims(), &[128, 384]);
    assert_eq!(raw["h.5.mlp.c_proj.weight"].dims(), &[512, 128]);
    let (back, n_head) = BlockWeights::load_gpt2(&p, None).unwrap();
    assert_eq!(n_head, Some(4));
    for (x, y) in w.tensors().iter().zip(back.tensors()) {
        assert_eq!(flat(x), flat(y));
    }
    assert!(BlockWeights::load_gpt2(&p, Some(0)).unwrap_err().to_string().contains("no layer 0"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn layer_keys() {
    assert_eq!(layer_of("h.11.ln_1.weight"), Some(11));
    assert_eq!(layer_of("transformer.h.3.ln_1.weight"), Some(3));
    assert_eq!(layer_of("transformer.h.3.ln_2.weight"), None);
    assert_eq!(layer_of("xh.3.ln_1.weight"), None);
}

/// A header naming one tensor twice (with different data) is refused naming the key, not blamed
/// on the values the later entry points at.
#[test]
fn repeated_header_key_is_named() {
    let dir = std::env::temp_dir().join(format!("speedkit-dupkey-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join("w.safetensors");
    BlockWeights::from_seed(&crate::preset::Preset::Tiny.shape(), 0).unwrap().save_gpt2(&p, 0, 4).unwrap();
    let good = std::fs::read(&p).unwrap();
    let n = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&good[8..8 + n]).unwrap().trim_end();
    // The bias entry repeated at the end with its data moved onto the gain's bytes.
    let v: serde_json::Value = serde_json::from_str(header).unwrap();
    let key = "h.0.ln_1.bias";
    let mut entry = v[key].clone();
    entry["data_offsets"] = v["h.0.ln_1.weight"]["data_offsets"].clone();
    let h = format!("{},\"{key}\":{entry}}}", header.strip_suffix('}').unwrap());
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend(h.as_bytes());
    bytes.extend(&good[8 + n..]);
    std::fs::write(&p, &bytes).unwrap();
    let e = BlockWeights::load_gpt2(&p, None).unwrap_err().to_string();
    assert!(e.contains("\"h.0.ln_1.bias\" twice") && e.contains("w.safetensors") && e.contains("Fix"), "{e}");
    assert!(!e.contains("NaN"), "{e}");
    assert_eq!(duplicate_key(&good), None);
    std::fs::remove_dir_all(&dir).ok();
}
