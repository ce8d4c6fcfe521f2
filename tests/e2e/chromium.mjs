// What both page drivers share: headless Debian Chromium with a fake microphone playing
// a WAV, resolving nothing but loopback (and ``host``, mapped to 127.0.0.1), and the
// run that saves its result as OUT_DIR/result.json whatever happens.
import { writeFileSync } from "node:fs";
import { join } from "node:path";
import { chromium } from "playwright-core";

export function launch(wav, host = "127.0.0.1") {
  const mapped = host === "127.0.0.1" ? "" : `MAP ${host} 127.0.0.1 , `;
  return chromium.launch({
    executablePath: "/usr/bin/chromium",
    headless: true,
    args: [
      "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
      "--disable-background-networking", "--disable-component-update", "--disable-sync",
      `--host-resolver-rules=${mapped}MAP * ~NOTFOUND , EXCLUDE 127.0.0.1`,
      "--allow-loopback-in-peer-connection",
      "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
      `--use-file-for-fake-audio-capture=${wav}%noloop`,
      "--autoplay-policy=no-user-gesture-required",
    ],
  });
}

// Runs ``body(result)``; ``result.ok`` says it finished, ``result.error`` why not (and
// ``failed(result)``, if given, adds what the page knew when it failed).
export async function run(browser, out, result, body, failed = null) {
  try {
    await body(result);
    result.ok = true;
  } catch (error) {
    result.error = String(error);
    if (failed) await failed(result).catch((e) => { result.failedSnapshot = String(e); });
  } finally {
    await browser.close();
    writeFileSync(join(out, "result.json"), JSON.stringify(result));
  }
}
