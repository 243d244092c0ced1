//! Unit tests of `shared/src/breakdown.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn parts_are_timed_in_order_and_a_noop_outside_a_recording() {
    // Outside `record`, `part` does nothing (and needs no device).
    part("ln1").unwrap();
    let b = record(&Device::Cpu, 1, 3, || {
        part("a")?;
        std::thread::sleep(std::time::Duration::from_millis(3));
        part("b")?;
        std::thread::sleep(std::time::Duration::from_millis(1));
        Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)
    })
    .unwrap();
    let names: Vec<&str> = b.parts.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert!(b.parts[0].median_ms >= 3.0 && b.parts[1].median_ms >= 1.0, "{b:?}");
    for (i, total) in b.total_samples_ms.iter().enumerate() {
        assert_eq!(*total, b.parts[0].samples_ms[i] + b.parts[1].samples_ms[i], "each iteration's total is its parts' sum");
    }
    assert_eq!(b.iters, 3);
    assert!(text(&b, 4.0).contains("uninstrumented median 4.000 ms"));
    let m = merge(&b, &b).unwrap();
    assert_eq!((m.iters, m.parts[0].samples_ms.len(), m.total_samples_ms.len()), (6, 6, 6));
    assert_eq!(m.parts[1].median_ms, b.parts[1].median_ms);
}

/// Compiled with --features cuda (CI's cuda clippy), run only where CUDA tests run: the
/// events the boundaries record must time (cudarc's default is CU_EVENT_DISABLE_TIMING).
#[cfg(feature = "cuda")]
#[test]
fn cuda_boundary_events_time() {
    use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
    assert_eq!(TIMING_EVENT as u32 & CUevent_flags::CU_EVENT_DISABLE_TIMING as u32, 0);
}

#[test]
fn an_uninstrumented_forward_is_an_error() {
    let e = record(&Device::Cpu, 0, 1, || Tensor::zeros(1, candle_core::DType::F32, &Device::Cpu)).unwrap_err();
    assert!(e.to_string().contains("marked no part"), "{e}");
}
