//! The kernel's `inet_diag` answers as the shim reads them to decide whether a dump needs the
//! network lock: every length checked, never a panic, and each socket's state taken from
//! inside its own message.
#![no_main]

use crab_shim::sys::sockdiag::{parse, Answer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(Answer::States(states) | Answer::Done(states)) = parse(data) {
        // At most one state per 16-byte header plus its body.
        assert!(states.len() <= data.len() / 16);
    }
});
