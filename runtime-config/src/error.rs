use std::fmt;
use std::io;
use std::path::PathBuf;

/// Everything that can go wrong while reading crab's configuration.
///
/// Messages name the file, the dotted key (`store.state_dir`) and, where the
/// TOML parser knows it, the line and column, because the reader of a shim
/// error is an operator looking at a config file, not at crab's code.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file could not be read (it is missing, unreadable or not UTF-8).
    #[error("cannot read crab config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The TOML is malformed, or a key is unknown, has the wrong type or an
    /// invalid value.
    #[error("invalid crab config {}{}: {}{message}",
        origin.display(),
        location.map(|l| format!(":{l}")).unwrap_or_default(),
        key.as_ref().map(|k| format!("key `{k}`: ")).unwrap_or_default())]
    Invalid {
        /// The file the TOML came from (or the label the caller gave inline TOML).
        origin: PathBuf,
        /// Dotted path of the offending key; `None` for syntax errors that
        /// belong to no key.
        key: Option<String>,
        /// Where in the document the problem is, when the parser knows.
        location: Option<Location>,
        message: String,
    },

    /// `runc.binary` names no executable file.
    #[error("runc binary `{}` not found (runc.binary): {reason}", binary.display())]
    RuncBinaryNotFound { binary: PathBuf, reason: String },

    /// The bytes containerd sent as runtime options (`message`: `runtimeoptions.v1.Options` or
    /// `containerd.runc.v1.Options`) are not a valid encoding of that message.
    #[error("cannot decode containerd runtime options ({message}) at byte {offset}: {reason}")]
    RuntimeOptions {
        message: &'static str,
        offset: usize,
        reason: String,
    },

    /// The runtime options are of a type crab does not read (neither its own nor runc's).
    #[error("runtime options of type `{type_url}` are neither crab's (runtimeoptions.v1.Options: ConfigPath or ConfigBody) nor runc's (containerd.runc.v1.Options): register crab with runtime_type io.containerd.crab.v1 or io.containerd.runc.v2 (see crab's docs/kubernetes.md and docs/configuration.md)")]
    ForeignRuntimeOptions { type_url: String },

    /// runc options that crab cannot honour (the field and why).
    #[error("runc runtime option {field} is not supported by crab: {reason}")]
    UnsupportedRuncOption { field: &'static str, reason: String },
}

/// A 1-based line and column (in characters) in a TOML document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    pub line: usize,
    pub column: usize,
}

impl Location {
    /// Translates a byte offset into `text` to a line and column.
    pub(crate) fn from_offset(text: &str, offset: usize) -> Location {
        let mut offset = offset.min(text.len());
        // A span may (in theory) start inside a multi-byte character.
        while !text.is_char_boundary(offset) {
            offset -= 1;
        }
        let before = &text[..offset];
        let line_start = before.rfind('\n').map_or(0, |i| i + 1);
        Location {
            line: before.matches('\n').count() + 1,
            column: before[line_start..].chars().count() + 1,
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn location_counts_lines_and_characters() {
        let text = "a = 1\nbé = 2\n";
        assert_eq!(
            Location::from_offset(text, 0),
            Location { line: 1, column: 1 }
        );
        assert_eq!(
            Location::from_offset(text, 6),
            Location { line: 2, column: 1 }
        );
        // 'é' is two bytes but one column.
        assert_eq!(
            Location::from_offset(text, 9),
            Location { line: 2, column: 3 }
        );
        assert_eq!(
            Location::from_offset(text, 8),
            Location { line: 2, column: 2 }
        );
        assert_eq!(
            Location::from_offset(text, 100),
            Location { line: 3, column: 1 }
        );
    }
}
