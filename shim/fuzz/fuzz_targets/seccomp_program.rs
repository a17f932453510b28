//! A restored thread's seccomp filter program (an image's bytes, as the kernel installed them)
//! compared with runc's program for the spec (`restore::seccomp::decides_as`), and the task
//! iterator's records. Never a panic; a program accepted as runc's either is it or differs
//! only before libseccomp's part, which it leaves byte for byte; a program is always its own.
#![no_main]

use crab_shim::restore::seccomp::{decides_as, encode_insn as insn, parse_records};
use libfuzzer_sys::fuzz_target;

/// runc's shape: a stub (arch check, ENOSYS above syscall 456) ending in `ret ENOSYS`, then
/// libseccomp's part from `ld arch` (instruction 6).
fn reference() -> Vec<u8> {
    [
        insn(0x20, 0, 0, 4),
        insn(0x15, 0, 3, 0xc000_003e),
        insn(0x20, 0, 0, 0),
        insn(0x25, 1, 0, 456),
        insn(0x05, 0, 0, 1),
        insn(0x06, 0, 0, 0x0005_0026),
        insn(0x20, 0, 0, 4),
        insn(0x15, 1, 0, 0xc000_003e),
        insn(0x06, 0, 0, 0x8000_0000),
        insn(0x20, 0, 0, 0),
        insn(0x15, 0, 1, 2),
        insn(0x06, 0, 0, 0x0005_0001),
        insn(0x06, 0, 0, 0x7fff_0000),
    ]
    .concat()
}

fuzz_target!(|data: &[u8]| {
    let _ = parse_records(data);
    let reference = reference();
    // The fuzzer's bytes as a whole program, and spliced over the reference's start.
    let mut spliced = reference.clone();
    let n = data.len().min(spliced.len());
    spliced[..n].copy_from_slice(&data[..n]);
    for candidate in [data, &spliced[..]] {
        if decides_as(candidate, &reference) && candidate != reference.as_slice() {
            assert_eq!(candidate.len(), reference.len());
            assert_eq!(&candidate[6 * 8..], &reference[6 * 8..]);
        }
    }
    if !data.is_empty() && data.len() % 8 == 0 && data.len() <= 4000 * 8 {
        assert!(decides_as(data, data));
    }
});
