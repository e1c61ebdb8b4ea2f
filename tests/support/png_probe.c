/*
 * png_probe -- decodes a PNG with libpng, for tests/cli_test.sh (mha viz).
 *
 *   png_probe FILE.png [OUT.rgb]
 *
 * prints "WIDTH HEIGHT BIT_DEPTH COLOR_TYPE" of the file and, given OUT,
 * writes its pixels there as 8-bit RGB, row-major.  Exit 1 if it does not
 * decode.
 */
#include <png.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
    if (argc != 2 && argc != 3) {
        fprintf(stderr, "usage: png_probe FILE.png [OUT.rgb]\n");
        return 2;
    }
    png_image img;
    memset(&img, 0, sizeof img);
    img.version = PNG_IMAGE_VERSION;
    if (!png_image_begin_read_from_file(&img, argv[1])) {
        fprintf(stderr, "png_probe: %s: %s\n", argv[1], img.message);
        return 1;
    }
    /* The header as stored: 8-bit RGB is bit depth 8, color type 2. */
    FILE *f = fopen(argv[1], "rb");
    unsigned char ihdr[26] = {0};
    const int got = f && fread(ihdr, 1, sizeof ihdr, f) == sizeof ihdr;
    if (f)
        fclose(f);
    img.format = PNG_FORMAT_RGB;
    const size_t size = PNG_IMAGE_SIZE(img);
    unsigned char *px = malloc(size ? size : 1);
    if (!got || !px || !png_image_finish_read(&img, NULL, px, 0, NULL)) {
        fprintf(stderr, "png_probe: %s: %s\n", argv[1],
                px ? img.message : "out of memory");
        png_image_free(&img);
        free(px);
        return 1;
    }
    printf("%u %u %u %u\n", (unsigned)img.width, (unsigned)img.height,
           (unsigned)ihdr[24], (unsigned)ihdr[25]);
    int rc = 0;
    if (argc == 3) {
        FILE *o = fopen(argv[2], "wb");
        rc = !o || fwrite(px, 1, size, o) != size;
        if (o && fclose(o) != 0)
            rc = 1;
        if (rc)
            fprintf(stderr, "png_probe: cannot write %s\n", argv[2]);
    }
    free(px);
    return rc;
}
