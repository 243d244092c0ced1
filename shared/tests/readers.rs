//! The safetensors readers (`--weights`, `--input`) on random, truncated and
//! oversized files. Every outcome is `Ok` or a usage error naming the file — never a panic,
//! never an allocation the file's size does not justify.

use proptest::prelude::*;
use shared::preset::Preset;
use shared::weights::{load_input, BlockWeights};
use shared::SpeedkitError;
use std::path::PathBuf;

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("speedkit-readers-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A real file to damage: the tiny block's weights (layer 0) as --save-weights writes them.
fn weights_file(dir: &std::path::Path) -> Vec<u8> {
    let p = dir.join("w.safetensors");
    BlockWeights::from_seed(&Preset::Tiny.shape(), 0).unwrap().save_gpt2(&p, 0, 4).unwrap();
    std::fs::read(p).unwrap()
}

fn usage(e: &SpeedkitError, name: &str) -> bool {
    matches!(e, SpeedkitError::Usage(m) if m.contains(name) && m.contains("Fix"))
}

fn cases() -> u32 {
    std::env::var("SPEEDKIT_PROP_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(128)
}

#[test]
fn damaged_safetensors_are_refused_never_panic() {
    let dir = scratch();
    let good = weights_file(&dir);
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let p = dir.join("bad.safetensors");
    let ran = std::cell::Cell::new(0u32);
    let config = ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() };
    let header = String::from_utf8(good[8..8 + header_len].to_vec()).unwrap();
    let keys: Vec<String> = serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(&header).unwrap().keys().cloned().collect();
    proptest!(config, |(mode in 0u8..7, at in any::<prop::sample::Index>(), byte in any::<u8>(), len in any::<u64>(), noise in prop::collection::vec(any::<u8>(), 0..256))| {
        let mut bytes = good.clone();
        match mode {
            0 => bytes.truncate(at.index(bytes.len())), // truncated anywhere
            1 => { let i = 8 + at.index(header_len); bytes[i] = byte; } // one header byte changed
            2 => bytes[..8].copy_from_slice(&len.to_le_bytes()), // header length: random, oversized
            3 => bytes = noise.clone(), // random bytes
            5 => {
                // a key repeated (the entry copied to the header's end): the same tensor twice
                let key = &keys[at.index(keys.len())];
                let entry = format!("\"{key}\":{}", serde_json::from_str::<serde_json::Value>(&header).unwrap()[key]);
                let h = format!("{},{entry}}}", header.trim_end().strip_suffix('}').unwrap());
                bytes = (h.len() as u64).to_le_bytes().to_vec();
                bytes.extend(h.as_bytes());
                bytes.extend(&good[8 + header_len..]);
                std::fs::write(&p, &bytes).unwrap();
                let e = BlockWeights::load_gpt2(&p, None).unwrap_err();
                prop_assert!(usage(&e, &format!("{key:?} twice")), "the repeated key is not named: {e}");
                prop_assert!(!e.to_string().contains("NaN"), "a repeated key blamed on values: {e}");
            }
            6 => {
                // a tensor's rank changed (its shape flattened), named in the refusal
                let key = keys.iter().filter(|k| k.as_str() != "__metadata__").nth(at.index(keys.len() - 1)).unwrap();
                let mut v: serde_json::Value = serde_json::from_str(&header).unwrap();
                let n: u64 = v[key]["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap()).product();
                v[key]["shape"] = serde_json::json!([n]);
                let h = serde_json::to_string(&v).unwrap();
                bytes = (h.len() as u64).to_le_bytes().to_vec();
                bytes.extend(h.as_bytes());
                bytes.extend(&good[8 + header_len..]);
                std::fs::write(&p, &bytes).unwrap();
                if let Err(e) = BlockWeights::load_gpt2(&p, None) {
                    prop_assert!(usage(&e, key.as_str()), "the tensor is not named: {e}");
                }
            }
            _ => {
                // a header that declares a huge tensor over a few bytes of data
                let h = format!("{{\"x\":{{\"dtype\":\"F32\",\"shape\":[{len},{len},3],\"data_offsets\":[0,8]}}}}");
                bytes = (h.len() as u64).to_le_bytes().to_vec();
                bytes.extend(h.as_bytes());
                bytes.extend([0u8; 8]);
            }
        }
        std::fs::write(&p, &bytes).unwrap();
        if let Err(e) = BlockWeights::load_gpt2(&p, None) {
            prop_assert!(usage(&e, "bad.safetensors"), "{e}");
        }
        if let Err(e) = load_input(&p) {
            prop_assert!(usage(&e, "bad.safetensors"), "{e}");
        }
        ran.set(ran.get() + 1);
    });
    eprintln!("readers: {} damaged safetensors files read", ran.get());
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn devices_and_directories_are_refused_as_inputs() {
    for p in ["/dev/zero", "/dev/full", "/tmp"] {
        let p = std::path::Path::new(p);
        if p.exists() {
            assert!(usage(&load_input(p).unwrap_err(), "regular file"));
            assert!(usage(&BlockWeights::load_gpt2(p, None).unwrap_err(), "regular file"));
        }
    }
}
