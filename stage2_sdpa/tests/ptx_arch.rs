//! Regression (issue 13, finding 7): CUDA_COMPUTE_CAP=90a built `sm_90a` PTX, which does not
//! load on any GPU but Hopper. The attention kernel is now always plain `sm_XX` PTX.

#[path = "../ptx_arch.rs"]
mod ptx_arch;
use ptx_arch::ptx_arch;

#[test]
fn arch_specific_requests_build_plain_ptx() {
    for req in ["90a", "sm_90a", "90"] {
        assert_eq!(ptx_arch(Some(req)).unwrap().0, 90, "{req}");
    }
    let (cap, warning) = ptx_arch(Some("100a")).unwrap();
    assert_eq!(cap, 100);
    assert!(warning.unwrap().contains("plain sm_100"));
    assert!(ptx_arch(Some("90")).unwrap().1.is_none());
}

#[test]
fn spellings_of_a_capability() {
    assert_eq!(ptx_arch(None).unwrap(), (80, None));
    assert_eq!(ptx_arch(Some("8.9")).unwrap().0, 89);
    assert_eq!(ptx_arch(Some("compute_86")).unwrap().0, 86);
}

#[test]
fn old_gpus_build_sm80_with_a_warning_and_nonsense_is_an_error() {
    let (cap, warning) = ptx_arch(Some("75")).unwrap();
    assert_eq!(cap, 80);
    assert!(warning.unwrap().contains("below 80"));
    assert!(ptx_arch(Some("hopper")).unwrap_err().contains("not a compute capability"));
}
