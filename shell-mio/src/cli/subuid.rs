//! `--subuid-file`: the subordinate uid ranges (`/etc/subuid`) the node counts as their
//! owners (row 69). Reading and name lookup only; the rule is the core's
//! (`Trust::counted_uid`).

use kvwarden_core::node::trust::SubuidRange;
use std::path::Path;

/// Where the ranges are when `--subuid-file` is not given.
pub const DEFAULT_PATH: &str = "/etc/subuid";

/// The ranges of `path` (lines `owner:start:count`, the owner a user name or a uid;
/// blank lines and `#` comments skipped). A missing file is no ranges when `given` is
/// false (the default path); an owner name no user has is skipped with a WARNING.
pub fn read(path: &Path, given: bool) -> Result<Vec<SubuidRange>, String> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound && !given => {
            return Ok(Vec::new());
        }
        Err(error) => {
            return Err(format!(
                "--subuid-file {}: {error}; name a readable file of `owner:start:count` \
                 lines (as /etc/subuid), or leave the flag out",
                path.display()
            ));
        }
    };
    let mut ranges = Vec::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let bad = |why: &str| {
            format!(
                "--subuid-file {} line {}: {line:?}: {why}; each line is `owner:start:count` \
                 (a user name or uid, the first subordinate uid, how many), as in /etc/subuid",
                path.display(),
                index + 1
            )
        };
        let [owner, start, count] = line.split(':').collect::<Vec<_>>()[..] else {
            return Err(bad("not three fields"));
        };
        let start: u32 = start.parse().map_err(|_| bad("start is not a uid"))?;
        let count: u32 = count.parse().map_err(|_| bad("count is not a number"))?;
        let owner = match owner.parse::<u32>() {
            Ok(uid) => uid,
            Err(_) => match uid_of(owner) {
                Some(uid) => uid,
                None => {
                    tracing::warn!(
                        file = %path.display(),
                        line = index + 1,
                        owner,
                        "a subordinate uid range names a user this host does not know; \
                         its uids count as themselves"
                    );
                    continue;
                }
            },
        };
        ranges.push(SubuidRange {
            owner,
            start,
            count,
        });
    }
    Ok(ranges)
}

/// The uid of user `name` (the system's user database).
fn uid_of(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    let mut buffer = vec![0 as libc::c_char; 16 << 10];
    // SAFETY: an all-zero passwd is a valid value to be filled in.
    let mut entry: libc::passwd = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::passwd = std::ptr::null_mut();
    // SAFETY: every pointer is valid for the call; `buffer` outlives it, and `found`
    // points at `entry` or is null on return.
    let status = unsafe {
        libc::getpwnam_r(
            name.as_ptr(),
            &mut entry,
            buffer.as_mut_ptr(),
            buffer.len(),
            &mut found,
        )
    };
    (status == 0 && !found.is_null()).then_some(entry.pw_uid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_of_names_and_uids_are_read_and_bad_ones_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("subuid");
        std::fs::write(
            &path,
            "# ranges\nroot:100000:65536\n\n1001:200000:65536\nnobody-such-user-x:300000:10\n",
        )
        .unwrap();
        let ranges = read(&path, true).unwrap();
        assert_eq!(
            ranges,
            vec![
                SubuidRange {
                    owner: 0,
                    start: 100_000,
                    count: 65_536
                },
                SubuidRange {
                    owner: 1001,
                    start: 200_000,
                    count: 65_536
                },
            ],
            "an unknown user's line is skipped"
        );
        std::fs::write(&path, "1001:200000\n").unwrap();
        let error = read(&path, true).unwrap_err();
        assert!(
            error.contains("line 1") && error.contains("owner:start:count"),
            "{error}"
        );
        std::fs::write(&path, "1001:x:5\n").unwrap();
        assert!(
            read(&path, true)
                .unwrap_err()
                .contains("start is not a uid")
        );
        // Missing: no ranges at the default path, an error when named.
        let missing = dir.path().join("none");
        assert_eq!(read(&missing, false), Ok(vec![]));
        assert!(read(&missing, true).unwrap_err().contains("--subuid-file"));
    }
}
