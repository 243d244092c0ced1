//! Per-device caches for the CUDA paths: the cuBLASLt handle and workspace (stages 3 and 4).
//! (Kernel modules have their own cache, per device and kernel file: `kernel_cache`.)
//!
//! The key is the device itself — candle's `DeviceId`, unique per `CudaDevice` and so per
//! stream — and its compute capability. A GPU ordinal is not enough: two `CudaDevice`s on GPU 0
//! have two streams, and a handle bound to the first one's stream would run the second one's
//! GEMMs out of order with its other kernels.

use std::cell::RefCell;
use std::collections::HashMap;
use std::hash::Hash;

/// What identifies a device for a cache: `id` (candle's `DeviceId` on CUDA) and the compute
/// capability (major, minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceKey<I> {
    pub id: I,
    pub sm: (u32, u32),
}

/// A map from key to value that builds a value the first time its key is asked for.
pub struct Cache<K, V>(RefCell<HashMap<K, V>>);

impl<K: Eq + Hash, V: Clone> Cache<K, V> {
    pub fn new() -> Self {
        Cache(RefCell::new(HashMap::new()))
    }

    /// The value for `key`, made by `make` if there is none yet (an error is not cached).
    pub fn get_or_try_insert<E>(&self, key: K, make: impl FnOnce() -> Result<V, E>) -> Result<V, E> {
        if let Some(v) = self.0.borrow().get(&key) {
            return Ok(v.clone());
        }
        let v = make()?;
        self.0.borrow_mut().insert(key, v.clone());
        Ok(v)
    }

    pub fn len(&self) -> usize {
        self.0.borrow().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<K: Eq + Hash, V: Clone> Default for Cache<K, V> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A second device on GPU 0 (another stream) must not get the first one's handle.
    #[test]
    fn two_devices_on_one_gpu_get_their_own_entries() {
        let handles: Cache<DeviceKey<usize>, String> = Cache::new();
        let mut made = 0;
        let mut get = |id, sm| {
            handles
                .get_or_try_insert(DeviceKey { id, sm }, || {
                    made += 1;
                    Ok::<_, ()>(format!("handle on device {id}"))
                })
                .unwrap()
        };
        // devices 1 and 2 both on GPU 0 (ordinal 0), same architecture
        assert_eq!(get(1, (9, 0)), "handle on device 1");
        assert_eq!(get(2, (9, 0)), "handle on device 2");
        assert_eq!(get(1, (9, 0)), "handle on device 1");
        assert_eq!(made, 2);
    }

    #[test]
    fn values_are_made_once_per_key_and_errors_are_not_cached() {
        let ptx: Cache<(u32, u32), String> = Cache::new();
        assert!(ptx.get_or_try_insert((8, 0), || Err("failed")).is_err());
        assert!(ptx.is_empty());
        assert_eq!(ptx.get_or_try_insert((8, 0), || Ok::<_, ()>("compute_80".into())).unwrap(), "compute_80");
        assert_eq!(ptx.get_or_try_insert((9, 0), || Ok::<_, ()>("compute_90".into())).unwrap(), "compute_90");
        assert_eq!(ptx.get_or_try_insert((8, 0), || Ok::<_, ()>("recompiled".into())).unwrap(), "compute_80");
        assert_eq!(ptx.len(), 2);
    }
}
