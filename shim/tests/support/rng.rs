//! xorshift64*: a small reproducible generator for the tests that draw hostile or random
//! inputs from a seed (no dependency, the same sequence everywhere). Shared by the root-only
//! tests and the library's unit tests (`#[path]`).

/// xorshift64*; the seed must not be 0.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number below `n` (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}
