//! The DNS messages the name forwarder reads and writes: the one name a
//! query asks for, and the `REFUSED` answer to a query for a name the
//! policy does not allow. Pure functions over bytes; every length is
//! checked.

/// The DNS header's length.
const HEADER: usize = 12;
/// `QR`: the message is a response.
const QR: u8 = 0x80;
/// The opcode bits of the header's first flags byte.
const OPCODE: u8 = 0x78;
/// `RD`: recursion desired, echoed back.
const RD: u8 = 0x01;
/// The response code `REFUSED`.
const REFUSED: u8 = 5;

/// The name a standard query (opcode 0, one question, not a response)
/// asks for, lowercase, without a trailing dot, with the byte just past
/// its question; `None` for anything else, or a name that is not a host
/// name (compression in a question, an empty name, a label that is not
/// letters, digits and hyphens).
pub fn question(query: &[u8]) -> Option<(String, usize)> {
    let header = query.get(..HEADER)?;
    let flags = header.get(2)?;
    let questions = u16::from_be_bytes([*header.get(4)?, *header.get(5)?]);
    if flags & QR != 0 || flags & OPCODE != 0 || questions != 1 {
        return None;
    }
    let mut at = HEADER;
    let mut labels = Vec::new();
    loop {
        let len = usize::from(*query.get(at)?);
        at += 1;
        if len == 0 {
            break;
        }
        // 0xC0 and up are pointers (and 0x40–0xBF reserved): no question
        // of a real resolver uses them.
        if len > 63 {
            return None;
        }
        let label = query.get(at..at + len)?;
        labels.push(std::str::from_utf8(label).ok()?.to_ascii_lowercase());
        at += len;
    }
    // QTYPE and QCLASS.
    query.get(at..at + 4)?;
    let name = labels.join(".");
    berth_core::egress::is_host_name(&name).then_some((name, at + 4))
}

/// The `REFUSED` answer to `query`, whose question ends at `end` (see
/// [`question`]): its id and question, no records.
pub fn refused(query: &[u8], end: usize) -> Option<Vec<u8>> {
    let header = query.get(..HEADER)?;
    let asked = query.get(HEADER..end)?;
    let mut answer = Vec::with_capacity(end);
    answer.extend_from_slice(header.get(..2)?);
    answer.push(QR | (header.get(2)? & (OPCODE | RD)));
    answer.push(REFUSED);
    answer.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    answer.extend_from_slice(asked);
    Some(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A query for `name` (type A), as a stub resolver sends it.
    fn query(name: &str) -> Vec<u8> {
        let mut q = vec![0x12, 0x34, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0];
        for label in name.split('.') {
            q.push(u8::try_from(label.len()).unwrap());
            q.extend_from_slice(label.as_bytes());
        }
        q.extend_from_slice(&[0, 0, 1, 0, 1]);
        q
    }

    #[test]
    fn a_query_names_its_question_and_is_refused_with_it() {
        let q = query("Files.PythonHosted.org");
        let (name, end) = question(&q).unwrap();
        assert_eq!(name, "files.pythonhosted.org");
        assert_eq!(end, q.len());
        let answer = refused(&q, end).unwrap();
        assert_eq!(&answer[..2], &[0x12, 0x34], "the query's id");
        assert_eq!(answer[2], 0x81, "a response, recursion desired echoed");
        assert_eq!(answer[3] & 0x0f, 5, "REFUSED");
        assert_eq!(&answer[4..12], &[0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(&answer[12..], &q[12..]);
    }

    #[test]
    fn anything_but_one_plain_question_is_none() {
        let good = query("pypi.org");
        for cut in 0..good.len() {
            assert_eq!(question(&good[..cut]), None, "cut at {cut}");
        }
        let mut response = good.clone();
        response[2] |= QR;
        let mut update = good.clone();
        update[2] |= 5 << 3;
        let mut two = good.clone();
        two[5] = 2;
        let mut pointer = good.clone();
        pointer[12] = 0xc0;
        let odd = query("_sip._tcp.example.org");
        for bad in [response, update, two, pointer, odd, query("bad name.org")] {
            assert_eq!(question(&bad), None, "{bad:?}");
        }
    }
}
