//! Which architectures build.rs compiles cubins for (`kernel_build::build`, shared by stages 2–4).

use kernel_build::build::cubin_archs;

#[test]
fn arch_specific_requests_build_plain_cubins() {
    for req in ["90a", "sm_90a", "90"] {
        assert_eq!(cubin_archs(Some(req), 80, "t").unwrap().0, [90], "{req}");
    }
    let (archs, warnings) = cubin_archs(Some("100a"), 80, "t").unwrap();
    assert_eq!(archs, [100]);
    assert!(warnings[0].contains("plain sm_100"));
    assert!(cubin_archs(Some("90"), 80, "t").unwrap().1.is_empty());
}

#[test]
fn spellings_and_lists() {
    assert_eq!(cubin_archs(None, 80, "t").unwrap(), (vec![80], vec![]));
    assert_eq!(cubin_archs(Some("8.9"), 80, "t").unwrap().0, [89]);
    assert_eq!(cubin_archs(Some("compute_86"), 80, "t").unwrap().0, [86]);
    assert_eq!(cubin_archs(Some("90, 80,sm_90"), 80, "t").unwrap().0, [80, 90]);
}

#[test]
fn old_gpus_build_the_minimum_with_a_warning_and_nonsense_is_an_error() {
    let (archs, warnings) = cubin_archs(Some("75"), 80, "stage2_sdpa").unwrap();
    assert_eq!(archs, [80]);
    assert!(warnings[0].contains("below 80"));
    assert_eq!(cubin_archs(Some("75"), 75, "t").unwrap(), (vec![75], vec![]));
    assert!(cubin_archs(Some("hopper"), 80, "t").unwrap_err().contains("not a compute capability"));
    assert!(cubin_archs(Some(" , "), 80, "t").unwrap_err().contains("names no architecture"));
}
