//! Sizes as the command lines write them (`64K`, `2M`, `16G`), for the worker's, the
//! server's and the benchmarks' flags alike.

/// Parses sizes like `4096`, `64K`, `2M`, `1G` (powers of 1024).
pub fn parse_bytes(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let (digits, unit) = match text.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((at, _)) => text.split_at(at),
        None => (text, ""),
    };
    let number: u64 = digits
        .parse()
        .map_err(|_| format!("invalid size {text:?}: use a number of bytes, optionally with K, M or G (powers of 1024)"))?;
    let scale: u64 = match unit
        .to_ascii_uppercase()
        .trim_end_matches("IB")
        .trim_end_matches('B')
    {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return Err(format!("invalid size unit in {text:?}: use K, M or G")),
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("size {text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_parse_with_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("2M"), Ok(2 << 20));
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert!(parse_bytes("x").is_err());
        assert!(parse_bytes("3T").is_err());
    }
}
