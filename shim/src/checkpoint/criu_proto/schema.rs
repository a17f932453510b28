//! What a message of CRIU's is, to the strict reader: its own module so that the generated
//! field lists (`schemas`) and the reader (`criu_proto`) both depend on it and not on each
//! other.

/// The fields CRIU's `.proto` files give a message the checks read ([`super::schemas`],
/// generated from the installed CRIU's own descriptors): its name, every field number it knows,
/// and those that are `repeated`. A message is read as CRIU's protobuf-c would read it only if it
/// has no field outside these (which a newer CRIU could give a meaning crab does not know) and no
/// non-repeated field twice (protobuf keeps the last scalar but *merges* repeated embedded
/// messages: two `creds` entries are one to CRIU, with the first one's capability arrays and the
/// second one's ids). Both are refused.
pub(crate) struct Schema {
    pub(crate) name: &'static str,
    pub(crate) known: &'static [u32],
    pub(crate) repeated: &'static [u32],
}
