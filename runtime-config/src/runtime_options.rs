//! containerd's generic runtime options, as sent to non-runc shims.
//!
//! For a runtime type containerd does not know (such as `io.containerd.crab.v1`),
//! both `ctr run --runtime-config-path` and the CRI plugin's `[...options]`
//! table send `CreateTaskRequest.options` as an `Any` whose type URL is
//! [`RUNTIME_OPTIONS_TYPE_URL`] and whose value is this protobuf message:
//!
//! ```proto
//! package runtimeoptions.v1;
//! message Options {
//!     string type_url = 1;    // unused by crab
//!     string config_path = 2; // CRI `ConfigPath`, ctr --runtime-config-path
//!     string config_body = 3; // CRI `ConfigBody`: the TOML itself
//! }
//! ```
//!
//! The message is three strings, so a hand-written decoder is smaller than a
//! protobuf toolchain. containerd's runc options (`containerd.runc.v1.Options`:
//! `BinaryName`, `Root`, `SystemdCgroup`, `CriuPath`, ...) are sent only to
//! runtime types containerd knows as runc; they are not crab's, and crab takes
//! those settings from its own config file instead.

use std::path::{Path, PathBuf};

use crate::{Config, ConfigError, ConfigSource};

/// The `Any.type_url` containerd uses for [`RuntimeOptions`].
pub const RUNTIME_OPTIONS_TYPE_URL: &str = "runtimeoptions.v1.Options";

/// The parts of `runtimeoptions.v1.Options` crab uses. Empty strings (proto3's
/// "unset") become `None`. The shim prefers `config_body` (inline TOML) over
/// `config_path`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuntimeOptions {
    pub config_path: Option<PathBuf>,
    pub config_body: Option<String>,
}

impl RuntimeOptions {
    /// The config these options name, as the shim and crabctl both read it: the inline TOML
    /// (`ConfigBody`) first, else the file (`ConfigPath`), else the default file or the
    /// built-in defaults (see [`Config::load_or_default`]).
    pub fn load_config(
        options: Option<&RuntimeOptions>,
    ) -> Result<(Config, ConfigSource), ConfigError> {
        match options {
            Some(RuntimeOptions {
                config_body: Some(body),
                ..
            }) => {
                let origin = Path::new("<runtime options ConfigBody>");
                Ok((
                    Config::from_toml_str(body, origin)?,
                    ConfigSource::File(origin.into()),
                ))
            }
            Some(o) => Config::load_or_default(o.config_path.as_deref()),
            None => Config::load_or_default(None),
        }
    }
}

/// Decodes the `value` bytes of a `runtimeoptions.v1.Options` `Any`.
///
/// Unknown fields are skipped as protobuf requires (wire types varint,
/// 64-bit, length-delimited and 32-bit); truncated input, groups, invalid
/// wire types, a known field with the wrong wire type, and non-UTF-8 strings
/// are errors.
pub fn decode_runtime_options(bytes: &[u8]) -> Result<RuntimeOptions, ConfigError> {
    let mut reader = Reader { bytes, pos: 0 };
    let mut options = RuntimeOptions::default();
    while !reader.at_end() {
        let field_start = reader.pos;
        let key = reader.varint()?;
        let field = key >> 3;
        let wire_type = (key & 0x7) as u8;
        if field == 0 || field > MAX_FIELD_NUMBER {
            return Err(decode_error(
                field_start,
                format!("invalid field number {field}"),
            ));
        }
        match (field, wire_type) {
            (1, LEN) => {
                reader.length_delimited()?;
            }
            (2, LEN) => options.config_path = non_empty(reader.string()?).map(PathBuf::from),
            (3, LEN) => options.config_body = non_empty(reader.string()?),
            (1..=3, _) => {
                return Err(decode_error(
                    field_start,
                    format!(
                    "field {field} has wire type {wire_type}, expected {LEN} (length-delimited)"
                ),
                ))
            }
            (_, VARINT) => {
                reader.varint()?;
            }
            (_, I64) => {
                reader.take(8, reader.pos)?;
            }
            (_, LEN) => {
                reader.length_delimited()?;
            }
            (_, I32) => {
                reader.take(4, reader.pos)?;
            }
            (_, 3 | 4) => {
                return Err(decode_error(
                    field_start,
                    format!(
                        "field {field} uses group wire type {wire_type}, which is not supported"
                    ),
                ))
            }
            _ => {
                return Err(decode_error(
                    field_start,
                    format!("field {field} has invalid wire type {wire_type}"),
                ))
            }
        }
    }
    Ok(options)
}

/// The `shim_cgroup` of the options containerd writes to a shim's `start` command on stdin (a
/// serialised `Any`), when they are runc's (`containerd.runc.v1.Options`, field 3 `ShimCgroup`):
/// the cgroup the shim itself is to run in. crab's own options carry none; anything that does
/// not decode gives `None`.
pub fn shim_cgroup_of_start_options(any: &[u8]) -> Option<String> {
    let fields = |bytes: &[u8]| -> Option<Vec<(u64, Vec<u8>)>> {
        let mut reader = Reader { bytes, pos: 0 };
        let mut out = Vec::new();
        while !reader.at_end() {
            let key = reader.varint().ok()?;
            match (key & 0x7) as u8 {
                VARINT => {
                    reader.varint().ok()?;
                }
                I64 => {
                    reader.take(8, reader.pos).ok()?;
                }
                LEN => out.push((key >> 3, reader.length_delimited().ok()?.to_vec())),
                I32 => {
                    reader.take(4, reader.pos).ok()?;
                }
                _ => return None,
            }
        }
        Some(out)
    };
    let outer = fields(any)?;
    let type_url = outer
        .iter()
        .find(|(f, _)| *f == 1)
        .map(|(_, v)| v.as_slice())?;
    if !type_url.ends_with(b"containerd.runc.v1.Options") {
        return None;
    }
    let value = outer
        .iter()
        .find(|(f, _)| *f == 2)
        .map(|(_, v)| v.as_slice())?;
    let cgroup = fields(value)?.into_iter().find(|(f, _)| *f == 3)?.1;
    String::from_utf8(cgroup).ok().filter(|s| !s.is_empty())
}

const VARINT: u8 = 0;
const I64: u8 = 1;
const LEN: u8 = 2;
const I32: u8 = 5;
const MAX_FIELD_NUMBER: u64 = (1 << 29) - 1;

fn non_empty(s: String) -> Option<String> {
    Some(s).filter(|s| !s.is_empty())
}

fn decode_error(offset: usize, reason: impl Into<String>) -> ConfigError {
    ConfigError::RuntimeOptions {
        offset,
        reason: reason.into(),
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn at_end(&self) -> bool {
        self.pos == self.bytes.len()
    }

    fn varint(&mut self) -> Result<u64, ConfigError> {
        let start = self.pos;
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&byte) = self.bytes.get(self.pos) else {
                return Err(decode_error(start, "truncated varint"));
            };
            self.pos += 1;
            // The tenth byte may only hold bit 63, so it also ends the varint.
            if i == 9 && byte > 1 {
                return Err(decode_error(start, "varint overflows 64 bits"));
            }
            value |= u64::from(byte & 0x7f) << (7 * i);
            if byte & 0x80 == 0 {
                break;
            }
        }
        Ok(value)
    }

    /// Takes `n` bytes of a field whose encoding began at `field_offset`.
    fn take(&mut self, n: u64, field_offset: usize) -> Result<&'a [u8], ConfigError> {
        let left = self.bytes.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n <= left => {
                let taken = &self.bytes[self.pos..self.pos + n];
                self.pos += n;
                Ok(taken)
            }
            _ => Err(decode_error(
                field_offset,
                format!("truncated field: needs {n} bytes, {left} left"),
            )),
        }
    }

    fn length_delimited(&mut self) -> Result<&'a [u8], ConfigError> {
        let start = self.pos;
        let len = self.varint()?;
        self.take(len, start)
    }

    fn string(&mut self) -> Result<String, ConfigError> {
        let start = self.pos;
        let bytes = self.length_delimited()?;
        String::from_utf8(bytes.to_vec())
            .map_err(|err| decode_error(start, format!("string is not UTF-8: {err}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    #[test]
    fn shim_cgroup_only_from_runc_options() {
        let len = |field: u8, v: &[u8]| -> Vec<u8> {
            let mut out = vec![field << 3 | LEN, v.len() as u8];
            out.extend_from_slice(v);
            out
        };
        let any = |url: &str, value: Vec<u8>| [len(1, url.as_bytes()), len(2, &value)].concat();
        // runc's Options: no_pivot_root (varint 1), shim_cgroup (3), binary_name (6).
        let runc = [vec![1 << 3, 1], len(3, b"/kubepods/pod1"), len(6, b"runc")].concat();
        assert_eq!(
            shim_cgroup_of_start_options(&any(
                "type.googleapis.com/containerd.runc.v1.Options",
                runc.clone()
            ))
            .as_deref(),
            Some("/kubepods/pod1")
        );
        // crab's options: field 3 is the inline config, never a cgroup.
        let crab = len(3, b"[log]\nlevel = \"debug\"\n");
        assert_eq!(
            shim_cgroup_of_start_options(&any(RUNTIME_OPTIONS_TYPE_URL, crab)),
            None
        );
        assert_eq!(
            shim_cgroup_of_start_options(&any("containerd.runc.v1.Options", len(6, b"runc"))),
            None
        );
        assert_eq!(shim_cgroup_of_start_options(b""), None);
        assert_eq!(shim_cgroup_of_start_options(&[0x0a, 0x7f]), None);
    }

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push((v as u8) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn key(field: u64, wire_type: u8, out: &mut Vec<u8>) {
        varint(field << 3 | u64::from(wire_type), out);
    }

    fn string_field(field: u64, s: &[u8], out: &mut Vec<u8>) {
        key(field, LEN, out);
        varint(s.len() as u64, out);
        out.extend_from_slice(s);
    }

    fn err(bytes: &[u8]) -> (usize, String) {
        match decode_runtime_options(bytes) {
            Err(ConfigError::RuntimeOptions { offset, reason }) => (offset, reason),
            other => panic!("expected a decode error for {bytes:?}, got {other:?}"),
        }
    }

    #[test]
    fn empty_input_is_all_unset() {
        assert_eq!(
            decode_runtime_options(&[]).unwrap(),
            RuntimeOptions::default()
        );
    }

    #[test]
    fn decodes_literal_bytes() {
        // Options{type_url: "x", config_path: "/etc/crab/config.toml"} as Go's
        // proto.Marshal writes it.
        let mut bytes = vec![0x0a, 0x01, b'x', 0x12, 0x15];
        bytes.extend_from_slice(b"/etc/crab/config.toml");
        assert_eq!(
            decode_runtime_options(&bytes).unwrap(),
            RuntimeOptions {
                config_path: Some("/etc/crab/config.toml".into()),
                config_body: None,
            }
        );
    }

    #[test]
    fn decodes_all_fields_with_long_body() {
        // A body over 127 bytes needs a two-byte length varint.
        let body = format!("[log]\nlevel = \"debug\"\n# {}\n", "x".repeat(200));
        let mut bytes = Vec::new();
        string_field(1, b"io.containerd.crab.v1.Options", &mut bytes);
        string_field(2, b"/run/crab.toml", &mut bytes);
        string_field(3, body.as_bytes(), &mut bytes);
        let options = decode_runtime_options(&bytes).unwrap();
        assert_eq!(
            options.config_path.as_deref(),
            Some(Path::new("/run/crab.toml"))
        );
        assert_eq!(options.config_body.as_deref(), Some(body.as_str()));
    }

    #[test]
    fn empty_strings_are_unset_and_last_occurrence_wins() {
        let mut bytes = Vec::new();
        string_field(2, b"/first.toml", &mut bytes);
        string_field(2, b"/second.toml", &mut bytes);
        string_field(3, b"", &mut bytes);
        let options = decode_runtime_options(&bytes).unwrap();
        assert_eq!(
            options.config_path.as_deref(),
            Some(Path::new("/second.toml"))
        );
        assert_eq!(options.config_body, None);
    }

    #[test]
    fn skips_unknown_fields_of_every_wire_type() {
        let mut bytes = Vec::new();
        key(4, VARINT, &mut bytes);
        varint(u64::MAX, &mut bytes); // ten-byte varint
        key(5, I64, &mut bytes);
        bytes.extend_from_slice(&[0xff; 8]);
        string_field(2, b"/etc/crab/config.toml", &mut bytes);
        key(6, LEN, &mut bytes);
        varint(3, &mut bytes);
        bytes.extend_from_slice(&[0x12, 0x01, b'!']); // looks like field 2, must be skipped whole
        key(1000, I32, &mut bytes);
        bytes.extend_from_slice(&[1, 2, 3, 4]);
        string_field(3, b"log.level = \"warn\"", &mut bytes);
        key(MAX_FIELD_NUMBER, VARINT, &mut bytes);
        varint(1, &mut bytes);
        assert_eq!(
            decode_runtime_options(&bytes).unwrap(),
            RuntimeOptions {
                config_path: Some("/etc/crab/config.toml".into()),
                config_body: Some("log.level = \"warn\"".into()),
            }
        );
    }

    #[test]
    fn truncated_input_is_an_error() {
        let mut full = Vec::new();
        string_field(2, b"/etc/crab/config.toml", &mut full);
        // Every proper prefix that cuts into the field is truncated.
        for len in 1..full.len() {
            let (_, reason) = err(&full[..len]);
            assert!(reason.contains("truncated"), "prefix {len}: {reason}");
        }
        assert_eq!(
            err(&[0x12, 0x05, b'a']),
            (1, "truncated field: needs 5 bytes, 1 left".into())
        );
        assert_eq!(err(&[0x12]), (1, "truncated varint".into()));
        assert_eq!(err(&[0x80]), (0, "truncated varint".into()));
        // Unknown fields are length-checked too.
        assert_eq!(err(&[0x21, 1, 2, 3]).0, 1); // field 4, I64, 3 of 8 bytes
        assert_eq!(err(&[0x25, 1, 2]).0, 1); // field 4, I32, 2 of 4 bytes
        assert_eq!(err(&[0x20, 0xff]), (1, "truncated varint".into())); // field 4, VARINT
                                                                        // A length larger than any input must not overflow.
        let mut huge = vec![0x32];
        varint(u64::MAX, &mut huge);
        assert!(err(&huge).1.contains("truncated field"));
    }

    #[test]
    fn malformed_keys_and_varints_are_errors() {
        assert_eq!(err(&[0x00]), (0, "invalid field number 0".into()));
        assert!(err(&[0x23]).1.contains("group wire type 3")); // field 4, start group
        assert!(err(&[0x24]).1.contains("group wire type 4"));
        assert!(err(&[0x26]).1.contains("invalid wire type 6"));
        assert!(err(&[0x27]).1.contains("invalid wire type 7"));
        assert_eq!(
            err(&[0x10, 0x01]),
            (
                0,
                "field 2 has wire type 0, expected 2 (length-delimited)".into()
            )
        );
        assert!(err(&[0x1d, 0, 0, 0, 0])
            .1
            .contains("field 3 has wire type 5"));
        let mut too_big = vec![0x20];
        too_big.extend_from_slice(&[0xff; 9]);
        too_big.push(0x02);
        assert_eq!(err(&too_big), (1, "varint overflows 64 bits".into()));
        let mut too_long = vec![0x20];
        too_long.extend_from_slice(&[0x80; 10]);
        too_long.push(0x00);
        assert_eq!(err(&too_long), (1, "varint overflows 64 bits".into()));
        let mut field_too_big = Vec::new();
        key(MAX_FIELD_NUMBER + 1, VARINT, &mut field_too_big);
        field_too_big.push(0);
        assert!(err(&field_too_big).1.starts_with("invalid field number"));
    }

    #[test]
    fn non_utf8_string_is_an_error() {
        let mut bytes = Vec::new();
        string_field(3, &[b'a', 0xff], &mut bytes);
        let (offset, reason) = err(&bytes);
        assert_eq!(offset, 1);
        assert!(reason.starts_with("string is not UTF-8"), "{reason}");
    }

    #[test]
    fn error_message_names_the_message_type() {
        let msg = decode_runtime_options(&[0x12]).unwrap_err().to_string();
        assert_eq!(
            msg,
            "cannot decode containerd runtime options (runtimeoptions.v1.Options) at byte 1: truncated varint"
        );
    }
}
