//! Unit tests of `shared/src/device.rs`, compiled into that module (`#[path]`), so they
//! reach its private items.

use super::*;

#[test]
fn parses_device_flags() {
    assert_eq!("auto".parse::<DeviceRequest>().unwrap(), DeviceRequest::Auto);
    assert_eq!("CPU".parse::<DeviceRequest>().unwrap(), DeviceRequest::Cpu);
    assert_eq!("cuda".parse::<DeviceRequest>().unwrap(), DeviceRequest::Cuda(0));
    assert_eq!("cuda:3".parse::<DeviceRequest>().unwrap(), DeviceRequest::Cuda(3));
    assert!("cuda:x".parse::<DeviceRequest>().is_err());
    assert!("tpu".parse::<DeviceRequest>().is_err());
}

#[test]
fn capabilities_by_sm() {
    let h100 = DeviceInfo::simulated_cuda("H100", (9, 0));
    assert!(h100.has_fp8_tensor_cores() && h100.has_bf16_tensor_cores());
    let a100 = DeviceInfo::simulated_cuda("A100", (8, 0));
    assert!(a100.has_bf16_tensor_cores() && !a100.has_fp8_tensor_cores());
    assert!(DeviceInfo::simulated_cuda("L40S", (8, 9)).has_fp8_tensor_cores());
    let t4 = DeviceInfo::simulated_cuda("T4", (7, 5));
    assert!(t4.has_f16_tensor_cores() && !t4.has_bf16_tensor_cores());
    let cpu = cpu_info("test".into());
    assert!(!cpu.has_f16_tensor_cores() && !cpu.has_fp8_tensor_cores());
}

#[cfg(not(feature = "cuda"))]
#[test]
fn cuda_in_cpu_build_names_the_feature() {
    let e = select(DeviceRequest::Cuda(0)).unwrap_err().to_string();
    assert!(e.contains("--features cuda"), "{e}");
    let (d, info) = select(DeviceRequest::Auto).unwrap();
    assert!(d.is_cpu() && info.why.contains("no CUDA support"));
}

/// A pool whose frees land only at `synchronize`, like the stream-ordered allocator.
#[derive(Default)]
struct FakePool {
    used: u64,
    high: u64,
    queued_free: u64,
}
impl FakePool {
    fn alloc(&mut self, n: u64) {
        self.used += n;
        self.high = self.high.max(self.used);
    }
}
struct Shared(std::rc::Rc<std::cell::RefCell<FakePool>>);
impl MemCounters for Shared {
    fn synchronize(&mut self) {
        let mut p = self.0.borrow_mut();
        p.used -= std::mem::take(&mut p.queued_free);
    }
    fn used(&mut self) -> Option<u64> {
        Some(self.0.borrow().used)
    }
    fn reset_high(&mut self) {
        let mut p = self.0.borrow_mut();
        p.high = p.used;
    }
    fn high(&mut self) -> Option<u64> {
        Some(self.0.borrow().high)
    }
}

/// A transient allocation (stage 0's T×T scores) freed before the end still counts, and a
/// previous stage's queued free does not count as in use at the start.
#[test]
fn cuda_probe_sees_a_transient_allocation() {
    let pool = std::rc::Rc::new(std::cell::RefCell::new(FakePool::default()));
    pool.borrow_mut().alloc(500); // an earlier stage's memory, freed but not yet synchronized
    pool.borrow_mut().queued_free = 500;
    let mut probe = MemProbe::with_counters(Box::new(Shared(pool.clone())), "fake");
    pool.borrow_mut().alloc(100); // weights, kept
    pool.borrow_mut().alloc(1000); // scores, freed at once
    pool.borrow_mut().queued_free = 1000;
    // the stage's own check: a bigger twin, not counted
    probe.exclude(|| {
        pool.borrow_mut().alloc(5000);
        pool.borrow_mut().queued_free = 5000;
    });
    let (peak, _) = probe.finish();
    assert_eq!(peak, Some(1100));
}

#[cfg(target_os = "linux")]
#[test]
fn cpu_probe_sees_an_allocation() {
    let _alone = crate::BIG_ALLOCATION_TESTS.lock().unwrap_or_else(|e| e.into_inner());
    let probe = MemProbe::start(&Device::Cpu);
    let v = vec![1u8; 64 << 20];
    std::hint::black_box(&v);
    let (peak, _) = probe.finish();
    assert!(peak.unwrap() >= 60 << 20, "{peak:?}");
}
