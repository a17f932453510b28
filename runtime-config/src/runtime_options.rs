//! containerd's runtime options, as the shim receives them.
//!
//! crab can be registered two ways, and each brings its own options message (`CreateTaskRequest.options`
//! and the `start` command's stdin carry it as an `Any`):
//!
//! - **Its own runtime type** (`io.containerd.crab.v1`): containerd does not know the type, so
//!   both `ctr run --runtime-config-path` and the CRI plugin's `[...options]` table send the generic
//!   [`RUNTIME_OPTIONS_TYPE_URL`] message:
//!
//!   ```proto
//!   package runtimeoptions.v1;
//!   message Options {
//!       string type_url = 1;    // unused by crab
//!       string config_path = 2; // CRI `ConfigPath`, ctr --runtime-config-path
//!       string config_body = 3; // CRI `ConfigBody`: the TOML itself
//!   }
//!   ```
//!
//! - **runc's runtime type** (`runtime_type = "io.containerd.runc.v2"` with `runtime_path` naming
//!   crab's shim): containerd treats the handler as runc (the CRI asks it for its features, allows
//!   user-namespaced pods and recursive read-only mounts) and sends runc's options
//!   ([`RUNC_OPTIONS_TYPE_URL`], [`RuncOptions`]). They cannot name crab's config, which then comes
//!   from `$CRAB_CONFIG` or the default file ([`crate::Config::load_or_default`]); the runc
//!   settings among them (`BinaryName`, `Root`, `SystemdCgroup`) override the config's `[runc]`.
//!
//! [`ShimOptions`] is either, decoded. Both messages are a few scalar fields, so a hand-written
//! decoder is smaller than a protobuf toolchain; it rejects malformed bytes with the offset.

use std::path::{Path, PathBuf};

use crate::{Config, ConfigError, ConfigSource};

const CRAB_MESSAGE: &str = "runtimeoptions.v1.Options";
const RUNC_MESSAGE: &str = "containerd.runc.v1.Options";

/// The `Any.type_url` containerd uses for [`RuntimeOptions`].
pub const RUNTIME_OPTIONS_TYPE_URL: &str = CRAB_MESSAGE;

/// The `Any.type_url` containerd uses for runc's options ([`RuncOptions`]).
pub const RUNC_OPTIONS_TYPE_URL: &str = RUNC_MESSAGE;

/// A task's runtime options, decoded: crab's own, runc's, or none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum ShimOptions {
    /// No options, or an empty `Any`.
    #[default]
    None,
    Crab(RuntimeOptions),
    Runc(RuncOptions),
}

impl ShimOptions {
    /// Decodes an `Any`'s type URL and value. Options of another runtime (gVisor's, Kata's) are
    /// refused with what to do instead; an empty value of any type is no options.
    pub fn decode(type_url: &str, value: &[u8]) -> Result<ShimOptions, ConfigError> {
        if type_url.ends_with(RUNTIME_OPTIONS_TYPE_URL) {
            Ok(ShimOptions::Crab(decode_runtime_options(value)?))
        } else if type_url.ends_with(RUNC_OPTIONS_TYPE_URL) {
            Ok(ShimOptions::Runc(decode_runc_options(value)?))
        } else if value.is_empty() {
            Ok(ShimOptions::None)
        } else {
            Err(ConfigError::ForeignRuntimeOptions {
                type_url: type_url.to_string(),
            })
        }
    }

    /// The config these options lead to, as the shim and crabctl both read it: crab's options
    /// name it (see [`RuntimeOptions::load_config`]); with runc's or none, `$CRAB_CONFIG`, the
    /// default file or the built-in defaults ([`Config::load_or_default`]), with runc's
    /// settings applied on top ([`RuncOptions::apply_to`]).
    pub fn load_config(&self) -> Result<(Config, ConfigSource), ConfigError> {
        match self {
            ShimOptions::Crab(o) => RuntimeOptions::load_config(Some(o)),
            ShimOptions::None => Config::load_or_default(None),
            ShimOptions::Runc(o) => {
                let (mut config, source) = Config::load_or_default(None)?;
                o.apply_to(&mut config)?;
                Ok((config, source))
            }
        }
    }

    /// runc's options, if these are.
    pub fn runc(&self) -> Option<&RuncOptions> {
        match self {
            ShimOptions::Runc(o) => Some(o),
            _ => None,
        }
    }
}

/// containerd's runc options (`containerd.runc.v1.Options`, containerd's
/// `api/types/runc/options/oci.proto`), as containerd sends them to a handler registered with
/// runc's runtime type. proto3: an empty string or a zero is "unset".
///
/// What crab does with each: `binary_name`, `root`, `systemd_cgroup` override the config's
/// `[runc]` ([`RuncOptions::apply_to`]); `no_pivot_root` and `no_new_keyring` are passed to `runc
/// create`; `shim_cgroup` is the cgroup the shim joins; `io_uid`/`io_gid` own the stdio pipes (the
/// CRI sets them for user-namespaced pods, so that the container's root can reopen its own
/// stdout); `criu_image_path`/`criu_work_path` are runc's defaults for a checkpoint request
/// without paths, which crab does not need (its checkpoints go to its store, the request's own
/// paths are honoured); `task_api_address` (a shim serving the task API elsewhere) is refused.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RuncOptions {
    pub no_pivot_root: bool,
    pub no_new_keyring: bool,
    pub shim_cgroup: Option<String>,
    pub io_uid: u32,
    pub io_gid: u32,
    pub binary_name: Option<String>,
    pub root: Option<PathBuf>,
    pub systemd_cgroup: bool,
    pub criu_image_path: Option<PathBuf>,
    pub criu_work_path: Option<PathBuf>,
    pub task_api_address: Option<String>,
    pub task_api_version: u32,
}

impl RuncOptions {
    /// Applies the runc settings to `config`'s `[runc]`: `BinaryName` (a command name looked up
    /// on `PATH`, or an absolute path, as `runc.binary`), `Root` (absolute) and `SystemdCgroup`
    /// (`true` turns it on; proto3 cannot say "off" apart from "unset"). Refuses what crab cannot
    /// honour.
    pub fn apply_to(&self, config: &mut Config) -> Result<(), ConfigError> {
        if let Some(addr) = &self.task_api_address {
            return Err(ConfigError::UnsupportedRuncOption {
                field: "TaskApiAddress",
                reason: format!(
                    "`{addr}`: crab serves the task API on its own socket; remove TaskApiAddress \
                     from the handler's options"
                ),
            });
        }
        if let Some(name) = &self.binary_name {
            let path = Path::new(name);
            let is_command_name = path.components().count() == 1 && path.file_name().is_some();
            if !(path.is_absolute() || is_command_name) {
                return Err(ConfigError::UnsupportedRuncOption {
                    field: "BinaryName",
                    reason: format!(
                        "`{name}` is neither a command name (looked up on PATH) nor an absolute path"
                    ),
                });
            }
            config.runc.binary = path.to_path_buf();
        }
        if let Some(root) = &self.root {
            if !root.is_absolute() {
                return Err(ConfigError::UnsupportedRuncOption {
                    field: "Root",
                    reason: format!("`{}` is not an absolute path", root.display()),
                });
            }
            config.runc.root = root.clone();
        }
        if self.systemd_cgroup {
            config.runc.systemd_cgroup = true;
        }
        Ok(())
    }

    /// The owner the stdio pipes get (`IoUid`, `IoGid`), when either is set.
    pub fn io_owner(&self) -> Option<(u32, u32)> {
        (self.io_uid != 0 || self.io_gid != 0).then_some((self.io_uid, self.io_gid))
    }
}

/// Decodes the `value` bytes of a `containerd.runc.v1.Options` `Any`, with the same rules as
/// [`decode_runtime_options`] (unknown fields skipped; truncation, groups, a known field of the
/// wrong wire type and non-UTF-8 strings are errors).
pub fn decode_runc_options(bytes: &[u8]) -> Result<RuncOptions, ConfigError> {
    let mut o = RuncOptions::default();
    decode_fields(bytes, RUNC_MESSAGE, |field, reader| {
        let path = |s: String| non_empty(s).map(PathBuf::from);
        match field {
            1 => o.no_pivot_root = reader.bool()?,
            2 => o.no_new_keyring = reader.bool()?,
            3 => o.shim_cgroup = non_empty(reader.string()?),
            4 => o.io_uid = reader.uint32()?,
            5 => o.io_gid = reader.uint32()?,
            6 => o.binary_name = non_empty(reader.string()?),
            7 => o.root = path(reader.string()?),
            9 => o.systemd_cgroup = reader.bool()?,
            10 => o.criu_image_path = path(reader.string()?),
            11 => o.criu_work_path = path(reader.string()?),
            12 => o.task_api_address = non_empty(reader.string()?),
            13 => o.task_api_version = reader.uint32()?,
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(o)
}

/// The wire type each known field of runc's options has.
fn runc_wire_type(field: u64) -> Option<u8> {
    match field {
        1 | 2 | 4 | 5 | 9 | 13 => Some(VARINT),
        3 | 6 | 7 | 10 | 11 | 12 => Some(LEN),
        _ => None,
    }
}

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
    let mut options = RuntimeOptions::default();
    decode_fields(bytes, CRAB_MESSAGE, |field, reader| {
        match field {
            1 => {
                reader.length_delimited()?;
            }
            2 => options.config_path = non_empty(reader.string()?).map(PathBuf::from),
            3 => options.config_body = non_empty(reader.string()?),
            _ => return Ok(false),
        }
        Ok(true)
    })?;
    Ok(options)
}

/// The wire type of a known field of `message`, for [`decode_fields`].
fn known_wire_type(message: &'static str, field: u64) -> Option<u8> {
    match message {
        CRAB_MESSAGE => (1..=3).contains(&field).then_some(LEN),
        _ => runc_wire_type(field),
    }
}

/// Walks the fields of a protobuf message: `known(field, reader)` reads a known field (checked
/// against its wire type first) and returns whether it did; everything else is skipped as
/// protobuf requires (wire types varint, 64-bit, length-delimited and 32-bit). Groups, invalid
/// wire types and field numbers, and truncation are errors naming `message` and the offset.
fn decode_fields<'a>(
    bytes: &'a [u8],
    message: &'static str,
    mut known: impl FnMut(u64, &mut Reader<'a>) -> Result<bool, ConfigError>,
) -> Result<(), ConfigError> {
    let mut reader = Reader {
        bytes,
        pos: 0,
        message,
    };
    while !reader.at_end() {
        let field_start = reader.pos;
        let key = reader.varint()?;
        let field = key >> 3;
        let wire_type = (key & 0x7) as u8;
        if field == 0 || field > MAX_FIELD_NUMBER {
            return Err(reader.error(field_start, format!("invalid field number {field}")));
        }
        if let Some(expected) = known_wire_type(message, field) {
            if wire_type != expected {
                let name = if expected == LEN {
                    "length-delimited"
                } else {
                    "varint"
                };
                return Err(reader.error(
                    field_start,
                    format!(
                        "field {field} has wire type {wire_type}, expected {expected} ({name})"
                    ),
                ));
            }
            if known(field, &mut reader)? {
                continue;
            }
        }
        match wire_type {
            VARINT => {
                reader.varint()?;
            }
            I64 => {
                reader.take(8, reader.pos)?;
            }
            LEN => {
                reader.length_delimited()?;
            }
            I32 => {
                reader.take(4, reader.pos)?;
            }
            3 | 4 => {
                return Err(reader.error(
                    field_start,
                    format!(
                        "field {field} uses group wire type {wire_type}, which is not supported"
                    ),
                ))
            }
            _ => {
                return Err(reader.error(
                    field_start,
                    format!("field {field} has invalid wire type {wire_type}"),
                ))
            }
        }
    }
    Ok(())
}

/// The `shim_cgroup` of the options containerd writes to a shim's `start` command on stdin (a
/// serialised `Any`), when they are runc's (`containerd.runc.v1.Options`, field 3 `ShimCgroup`):
/// the cgroup the shim itself is to run in. crab's own options carry none; anything that does
/// not decode gives `None`.
pub fn shim_cgroup_of_start_options(any: &[u8]) -> Option<String> {
    let fields = |bytes: &[u8]| -> Option<Vec<(u64, Vec<u8>)>> {
        let mut reader = Reader {
            bytes,
            pos: 0,
            message: RUNC_MESSAGE,
        };
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

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
    /// The message being decoded, for errors.
    message: &'static str,
}

impl<'a> Reader<'a> {
    fn error(&self, offset: usize, reason: impl Into<String>) -> ConfigError {
        ConfigError::RuntimeOptions {
            message: self.message,
            offset,
            reason: reason.into(),
        }
    }

    fn bool(&mut self) -> Result<bool, ConfigError> {
        Ok(self.varint()? != 0)
    }

    /// A `uint32`: protobuf keeps the low 32 bits of a larger varint.
    fn uint32(&mut self) -> Result<u32, ConfigError> {
        Ok(self.varint()? as u32)
    }

    fn at_end(&self) -> bool {
        self.pos == self.bytes.len()
    }

    fn varint(&mut self) -> Result<u64, ConfigError> {
        let start = self.pos;
        let mut value = 0u64;
        for i in 0..10 {
            let Some(&byte) = self.bytes.get(self.pos) else {
                return Err(self.error(start, "truncated varint"));
            };
            self.pos += 1;
            // The tenth byte may only hold bit 63, so it also ends the varint.
            if i == 9 && byte > 1 {
                return Err(self.error(start, "varint overflows 64 bits"));
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
            _ => Err(self.error(
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
            .map_err(|err| self.error(start, format!("string is not UTF-8: {err}")))
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
            Err(ConfigError::RuntimeOptions { offset, reason, .. }) => (offset, reason),
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

    /// runc's options as containerd's Go code marshals them (field order, proto3 zero values
    /// left out).
    fn runc_options_bytes() -> Vec<u8> {
        let mut b = Vec::new();
        key(1, VARINT, &mut b);
        varint(1, &mut b); // no_pivot_root
        string_field(3, b"/kubepods/burstable/pod1", &mut b); // shim_cgroup
        key(4, VARINT, &mut b);
        varint(65536, &mut b); // io_uid
        key(5, VARINT, &mut b);
        varint(65537, &mut b); // io_gid
        string_field(6, b"/usr/local/sbin/runc", &mut b); // binary_name
        string_field(7, b"/run/k8s/runc", &mut b); // root
        key(9, VARINT, &mut b);
        varint(1, &mut b); // systemd_cgroup
        string_field(10, b"/var/lib/criu-images", &mut b);
        key(13, VARINT, &mut b);
        varint(2, &mut b); // task_api_version
        b
    }

    #[test]
    fn decodes_runc_options() {
        let o = decode_runc_options(&runc_options_bytes()).unwrap();
        assert_eq!(
            o,
            RuncOptions {
                no_pivot_root: true,
                no_new_keyring: false,
                shim_cgroup: Some("/kubepods/burstable/pod1".into()),
                io_uid: 65536,
                io_gid: 65537,
                binary_name: Some("/usr/local/sbin/runc".into()),
                root: Some("/run/k8s/runc".into()),
                systemd_cgroup: true,
                criu_image_path: Some("/var/lib/criu-images".into()),
                criu_work_path: None,
                task_api_address: None,
                task_api_version: 2,
            }
        );
        assert_eq!(o.io_owner(), Some((65536, 65537)));
        assert_eq!(decode_runc_options(&[]).unwrap(), RuncOptions::default());
        assert_eq!(RuncOptions::default().io_owner(), None);
    }

    #[test]
    fn hostile_runc_options_are_errors_naming_the_message() {
        let run = |bytes: &[u8]| match decode_runc_options(bytes) {
            Err(e @ ConfigError::RuntimeOptions { .. }) => e.to_string(),
            other => panic!("expected a decode error for {bytes:?}, got {other:?}"),
        };
        // A string field sent as a varint, a bool sent as a string.
        assert!(run(&[0x30, 0x01]).contains("field 6 has wire type 0, expected 2"));
        assert!(run(&[0x0a, 0x01, b'x']).contains("field 1 has wire type 2, expected 0 (varint)"));
        // Truncation anywhere in a valid encoding.
        let full = runc_options_bytes();
        for len in 1..full.len() {
            if decode_runc_options(&full[..len]).is_ok() {
                continue; // a prefix can end exactly between fields
            }
            assert!(run(&full[..len]).contains("containerd.runc.v1.Options"));
        }
        // Non-UTF-8 paths, groups, bad field numbers.
        let mut bad = Vec::new();
        string_field(7, &[b'/', 0xff], &mut bad);
        assert!(run(&bad).contains("not UTF-8"));
        assert!(run(&[0x43]).contains("group wire type 3")); // field 8 (reserved), start group
        assert!(run(&[0x00]).contains("invalid field number 0"));
        // A varint above u32 keeps its low 32 bits, as protobuf does; it is no error.
        let mut big = Vec::new();
        key(4, VARINT, &mut big);
        varint(u64::from(u32::MAX) + 2, &mut big);
        assert_eq!(decode_runc_options(&big).unwrap().io_uid, 1);
    }

    #[test]
    fn shim_options_by_type_url() {
        let mut crab = Vec::new();
        string_field(2, b"/etc/crab/other.toml", &mut crab);
        assert!(matches!(
            ShimOptions::decode("type.googleapis.com/runtimeoptions.v1.Options", &crab).unwrap(),
            ShimOptions::Crab(RuntimeOptions { config_path: Some(p), .. }) if p == Path::new("/etc/crab/other.toml")
        ));
        let runc =
            ShimOptions::decode("containerd.runc.v1.Options", &runc_options_bytes()).unwrap();
        assert_eq!(runc.runc().unwrap().io_uid, 65536);
        assert_eq!(
            ShimOptions::decode("io.containerd.kata.v2.Options", &[]).unwrap(),
            ShimOptions::None
        );
        let err = ShimOptions::decode("io.containerd.runsc.v1.options", &[0x08, 0x01]).unwrap_err();
        assert!(
            err.to_string().contains("io.containerd.runc.v2"),
            "the error says how to register crab: {err}"
        );
    }

    #[test]
    fn runc_options_override_the_runc_table() {
        let mut config = Config::default();
        let o = decode_runc_options(&runc_options_bytes()).unwrap();
        o.apply_to(&mut config).unwrap();
        assert_eq!(config.runc.binary, Path::new("/usr/local/sbin/runc"));
        assert_eq!(config.runc.root, Path::new("/run/k8s/runc"));
        assert!(config.runc.systemd_cgroup);
        // Unset fields leave the config alone.
        let mut config = Config::default();
        RuncOptions::default().apply_to(&mut config).unwrap();
        assert_eq!(config, Config::default());
        let name_only = RuncOptions {
            binary_name: Some("crun".into()),
            ..Default::default()
        };
        name_only.apply_to(&mut config).unwrap();
        assert_eq!(config.runc.binary, Path::new("crun"));
        // What crab cannot take is refused by name.
        for (o, field) in [
            (
                RuncOptions {
                    binary_name: Some("bin/runc".into()),
                    ..Default::default()
                },
                "BinaryName",
            ),
            (
                RuncOptions {
                    root: Some("run/runc".into()),
                    ..Default::default()
                },
                "Root",
            ),
            (
                RuncOptions {
                    task_api_address: Some("unix:///run/x.sock".into()),
                    ..Default::default()
                },
                "TaskApiAddress",
            ),
        ] {
            let err = o.apply_to(&mut Config::default()).unwrap_err();
            assert!(
                matches!(err, ConfigError::UnsupportedRuncOption { field: f, .. } if f == field),
                "{err}"
            );
        }
    }
}
